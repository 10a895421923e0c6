"""The compile driver and its options: every stage recorded and timed, every failure the bridge's
error naming the stage (so ``fallback=True`` catches it), options checked up front with the
valid choices named, the passes usable as TVM pass objects."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import tvm

from tvmbridge import STAGE_NAMES, CompileOptions, ConversionError, add_tvm_dispatch, compile_training
from tvmbridge import pipeline
from tvmbridge.passes import Dedup, ExternalizeRandom, Simplify
from tvmbridge.tools import cli

from ..helpers import MLP, clone_module, is_tvm, max_errors, run_step


def test_every_stage_is_recorded_and_timed():
    compiled = compile_training(MLP(), (torch.randn(4, 32),))
    assert list(compiled.stages) == list(STAGE_NAMES)
    assert set(STAGE_NAMES) | {"total"} == set(compiled.compile_seconds)
    assert compiled.compile_seconds["total"] >= sum(v for k, v in compiled.compile_seconds.items() if k != "total") * 0.99
    assert isinstance(compiled.stages["trace"], torch.export.ExportedProgram)
    for name in ("convert", "random", "layer_norm", "dedup", "gradient", "simplify", "split", "offload", "fast_math"):
        assert isinstance(compiled.stages[name], tvm.IRModule), name
    assert "tvmbridge.random_site" in compiled.stages["convert"].script()  # the dropout's mask, a marker
    assert "tvmbridge.random_site" not in compiled.stages["random"].script()
    assert [s.kind for s in compiled.random_sites] == ["dropout"] and compiled.random_sites[0].p == 0.25
    assert {gv.name_hint for gv in compiled.stages["split"].functions} == {"forward", "forward_infer", "backward"}
    assert set(compiled.split.captures) <= set(compiled.stages["capture"])  # unused ones are dropped


def test_stages_do_not_change_their_inputs():
    """Each stage returns new artifacts: what an earlier stage made is still as it was."""
    compiled = compile_training(MLP(), (torch.randn(4, 32),))
    assert "R.matmul" in compiled.stages["split"].script()  # the offload stage made a new module
    assert "R.matmul" not in compiled.stages["offload"]["forward"].script()


@pytest.mark.parametrize("stage", ["simplify", "capture", "offload", "fast_math", "build"])
def test_a_failure_in_any_stage_names_it_and_fallback_catches_it(monkeypatch, stage):
    def broken(artifacts):
        raise RuntimeError("something deep inside went wrong")

    stages = tuple(dataclasses.replace(s, run=broken) if s.name == stage else s for s in pipeline.STAGES)
    monkeypatch.setattr(pipeline.stages, "STAGES", stages)
    with pytest.raises(ConversionError) as err:
        compile_training(MLP(), (torch.randn(4, 32),))
    assert err.value.stage == stage and "something deep inside went wrong" in str(err.value)
    m = MLP()
    with pytest.warns(UserWarning, match=f"keeping PyTorch.*\\[{stage}\\]"):
        add_tvm_dispatch(m, (torch.randn(4, 32),), fallback=True)
    x = torch.randn(4, 32)
    torch.manual_seed(0)
    got = m(x)
    assert not is_tvm(got)


def test_bad_options_are_refused_up_front_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown capture policy 'min_cut'.*\['min-cut', 'all'\]"):
        add_tvm_dispatch(MLP(), (torch.randn(4, 32),), capture="min_cut")
    with pytest.raises(ValueError, match="unknown matmul backend.*'auto', 'torch', 'onednn'"):
        CompileOptions(offload_matmul="cublas")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['fast_maths'\].*fast_math"):
        add_tvm_dispatch(MLP(), (torch.randn(4, 32),), fast_maths=False)
    with pytest.raises(ValueError, match="must be True or False"):
        CompileOptions(fuse="no")
    with pytest.raises(ValueError, match="bytes .* or a fraction"):
        CompileOptions(memory_budget="1GB")


def test_one_options_object_serves_the_api_and_the_command_line(capsys):
    opts = CompileOptions(capture="all", fast_math=False)
    assert opts.replace(fuse=False) == CompileOptions(capture="all", fast_math=False, fuse=False)
    assert opts.gemm_backend("cpu") == "auto" and opts.gemm_backend("cuda") is None
    assert CompileOptions(offload_matmul=False).gemm_backend("cpu") is None
    # a GPU's tensors run on torch's GEMM library only: 'auto' means it there, oneDNN is refused
    assert CompileOptions(offload_matmul=True).gemm_backend("cuda") == "torch"
    assert CompileOptions(offload_matmul="auto").gemm_backend("cuda") == "torch"
    with pytest.raises(ValueError, match="CPU only"):
        CompileOptions(offload_matmul="onednn").gemm_backend("cuda")
    torch.manual_seed(0)
    m = MLP()
    ref = clone_module(m)
    x = torch.randn(4, 32)
    add_tvm_dispatch(m, (x,), options=opts, memory_budget=None)
    compiled = m._tvm_dispatch.compiled
    assert compiled.options == opts and compiled.split.recomputed == []  # capture="all"
    assert "_gelu_fast" not in compiled.stages["fast_math"].script()
    assert max(max_errors(run_step(m, (x,)), run_step(ref, (x,))).values()) <= 1e-5
    with pytest.raises(SystemExit):
        cli.main(["demo", "--capture", "everything"])
    assert "unknown capture policy 'everything'" in capsys.readouterr().err


def test_passes_are_tvm_pass_objects_that_instruments_see():
    compiled = compile_training(MLP(), (torch.randn(4, 32),))
    seen: list[str] = []

    @tvm.instrument.pass_instrument
    class Names:
        def run_before_pass(self, mod, info):
            seen.append(info.name)

    with tvm.transform.PassContext(instruments=[Names()]):
        mod = tvm.transform.Sequential([ExternalizeRandom(), Dedup(), Simplify()])(compiled.stages["convert"])
    assert {"tvmbridge.ExternalizeRandom", "tvmbridge.RewriteBindings"} <= set(seen)
    assert mod["main"].params[-1].name == "random0" and tuple(mod["main"].params[-1].ty.shape) == (4, 64)
    assert "tvmbridge.random_site" in compiled.stages["convert"].script()  # the input was not changed


def test_a_stage_sees_only_the_fields_it_declares():
    """The driver hides undeclared fields and refuses undeclared writes: a stage's declarations
    are its real dependencies."""
    from tvmbridge.pipeline import Artifacts, Stage
    from tvmbridge.pipeline.driver import run_stage

    start = Artifacts(module=MLP(), args=(), kwargs={}, options=CompileOptions(), sizes={"s0": 3})
    honest = Stage("honest", lambda a: dataclasses.replace(a, num_index_checks=len(a.sizes)), lambda a: None,
                   reads=("sizes",), writes=("num_index_checks",))
    done = run_stage(honest, start)
    assert done.num_index_checks == 1 and done.module is start.module and done.sizes == {"s0": 3}
    peeks = Stage("peeks", lambda a: dataclasses.replace(a, num_index_checks=len(a.sizes)), lambda a: None,
                  reads=(), writes=("num_index_checks",))
    with pytest.raises(RuntimeError, match="stage peeks reads Artifacts.sizes"):
        run_stage(peeks, start)
    sneaks = Stage("sneaks", lambda a: dataclasses.replace(a, sizes={}), lambda a: None, reads=(), writes=())
    with pytest.raises(RuntimeError, match="stage sneaks changed Artifacts.sizes"):
        run_stage(sneaks, start)
    with pytest.raises(ValueError, match="does not have"):
        Stage("typo", lambda a: a, lambda a: None, reads=("primals",), writes=())


def test_every_stage_runs_under_its_declarations():
    """A full compile through the checking driver: every stage's reads and writes are complete
    (a missing one raises inside the stage), and the process cache holds the result."""
    from tvmbridge.caches import CACHES

    compiled = compile_training(MLP(), (torch.randn(4, 32),), reuse=True)
    assert set(compiled.stages) == set(STAGE_NAMES) and len(CACHES.compiles) == 1
    again = compile_training(MLP(), (torch.randn(4, 32),), reuse=True)
    assert again.executable is compiled.executable and again._pools is not compiled._pools
    assert "reused" in again.compile_seconds and CACHES.compiles.hits == 1


def test_bounded_cache_keeps_the_most_recently_used():
    from tvmbridge.caches import BoundedCache

    cache: BoundedCache[int] = BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the oldest
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3 and len(cache) == 2
    assert cache.get_or_make("d", lambda: 4) == 4 and cache.get("a") is None
    with pytest.raises(ValueError):
        BoundedCache(0)


def test_a_compile_trace_records_no_source_stacks_and_leaves_torch_s_switch_as_it_was():
    """Recording each node's Python stack is a fifth of an export; only the float64 localizer
    reads it. torch's process-wide switch is restored after the trace (a user's own setting kept)."""
    import torch.fx.config as fx_config

    from tvmbridge.frontend.export import trace

    saved = fx_config.do_not_emit_stack_traces
    try:
        for setting in (False, True):
            fx_config.do_not_emit_stack_traces = setting
            traced = trace(MLP(d=8, h=16), (torch.randn(2, 8),))
            assert fx_config.do_not_emit_stack_traces is setting
            assert not any(n.meta.get("stack_trace") for n in traced.exported.graph.nodes)
            kept = trace(MLP(d=8, h=16), (torch.randn(2, 8),), stack_traces=True)  # whatever the switch says
            assert fx_config.do_not_emit_stack_traces is setting
            assert any("forward" in (n.meta.get("stack_trace") or "") for n in kept.exported.graph.nodes)
    finally:
        fx_config.do_not_emit_stack_traces = saved


class _Writes(torch.nn.Module):
    """Writes in place what a forward may write: BatchNorm's running statistics, a counter
    twice, a buffer it also returns, and one of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps += 1
        self.steps += 1
        self.ema.mul_(0.9).add_(x.mean(0).detach() * 0.1)
        seen.add_(x.sum().detach())
        return self.bn(x).relu(), self.ema


def test_a_call_that_writes_buffers_and_inputs_is_exported_once_and_returns_their_new_values(monkeypatch):
    """The new values of what the call writes become outputs of the one decomposed export (a
    second export and decomposition was half of a BatchNorm model's trace), after the module's
    own outputs: buffers in state order, then the written inputs, each as PyTorch leaves it."""
    import copy

    from tvmbridge.frontend import export as export_module

    exports = []
    real = export_module._export
    monkeypatch.setattr(export_module, "_export", lambda *a, **k: exports.append(1) or real(*a, **k))
    module = _Writes().train()
    x, seen = torch.randn(6, 4), torch.full((), 2.0)
    traced = export_module.trace(module, (x, seen))
    assert len(exports) == 1
    assert traced.updated_buffers == ("steps", "ema", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked")
    assert traced.updated_inputs == (1,) and traced.num_user_outputs == 2

    reference, seen_reference = copy.deepcopy(module), seen.clone()
    out = reference(x, seen_reference)
    state = [t.detach().clone() for t in traced.state.tensors(module)]
    got = traced.exported.module()(x, seen.clone(), *state)
    buffers = dict(reference.named_buffers())
    expected = [*out, *(buffers[n] for n in traced.updated_buffers), seen_reference]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and torch.allclose(g, e, rtol=1e-6, atol=1e-6)
    assert torch.equal(module.steps, torch.zeros((), dtype=torch.int64))  # tracing wrote nothing


def test_a_decomposition_builds_no_guard_function_and_keeps_the_example_inputs(monkeypatch):
    """torch's decomposition unlifts the program with a guard function over every input's sizes
    (quadratic in the inputs) when it carries example inputs; its retrace is on fake tensors of
    those very sizes, so they are set aside for it, and restored on both programs after."""
    import torch.export._unlift as unlift

    from tvmbridge.frontend import export as export_module

    built = []
    real = unlift._convert_guards_code_to_fn
    monkeypatch.setattr(unlift, "_convert_guards_code_to_fn", lambda *a, **k: built.append(1) or real(*a, **k))
    raw = export_module.export_call(MLP(d=8, h=16), (torch.randn(2, 8),))
    assert raw.exported.example_inputs is not None
    traced = export_module.decompose_call(raw)
    assert not built
    assert raw.exported.example_inputs is not None and traced.exported.example_inputs is not None
    assert len(traced.exported.example_inputs[0]) == len(raw.inputs)
