"""The GEMM packed functions the offload pass calls, checked one by one against float64 torch:
every transpose flag, with and without bias, on both backends, plus the backend choice, and the
plan/pass split: applying a plan is pure."""
from __future__ import annotations

import itertools

import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax

from tvmbridge.backend.gemm_choice import ChoiceCache, GemmChooser
from tvmbridge.backend.offload import ApplyOffloadPlan, OffloadPlan, gemm_problems, plan_offload
from tvmbridge.kernels.gemm import GemmSpec, onednn_available, register_gemms

BACKENDS = ["torch"] + (["onednn"] if onednn_available() else [])


def _operand(shape: tuple[int, ...], transposed: bool, g: torch.Generator) -> torch.Tensor:
    """A tensor of logical ``shape`` stored either way; the packed function gets the storage."""
    if transposed:
        return torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g)
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ta,tb,bias", list(itertools.product([False, True], repeat=3)))
def test_gemm_functions_match_torch(backend, ta, tb, bias):
    register_gemms()
    g = torch.Generator().manual_seed(int(ta) * 4 + int(tb) * 2 + int(bias))
    m, k, n = 13, 70, 33  # odd sizes: no lucky alignment
    a, b = _operand((m, k), ta, g), _operand((k, n), tb, g)
    c = torch.randn(n, generator=g)
    a_log, b_log = (a.mT if ta else a), (b.mT if tb else b)
    want = a_log.double() @ b_log.double() + (c.double() if bias else 0)
    f = tvm_ffi.get_global_func(GemmSpec(backend, ta, tb, bias).name)
    args = [a, b, c] if bias else [a, b]
    out = torch.from_dlpack(f(*[tvm_ffi.from_dlpack(x) for x in args]))
    assert out.shape == (m, n) and out.is_contiguous()
    assert (out.double() - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_left_operand(backend):
    """A 3-D left operand times a 2-D weight (the un-flattened linear form)."""
    register_gemms()
    g = torch.Generator().manual_seed(7)
    a, w = torch.randn(2, 5, 16, generator=g), torch.randn(16, 9, generator=g)
    f = tvm_ffi.get_global_func(GemmSpec(backend, False, False).name)
    out = torch.from_dlpack(f(tvm_ffi.from_dlpack(a), tvm_ffi.from_dlpack(w)))
    torch.testing.assert_close(out, a @ w, rtol=1e-5, atol=1e-5)


def _matmul_module(dtype: str, a_shape, b_shape) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", relax.TensorType(a_shape, dtype)), relax.Var("y", relax.TensorType(b_shape, dtype))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, y))
        bb.emit_func_output(out)
    return bb.get()


def _offload(mod: tvm.IRModule, chooser: GemmChooser, sizes: dict[str, int] | None = None) -> tuple:
    """What the pipeline's offload stage does: the chooser decides, the plan records, the pass applies."""
    sizes = sizes or {}
    plan = plan_offload(mod, sizes, chooser.choose_all(gemm_problems(mod, sizes)))
    return ApplyOffloadPlan(plan)(mod), plan


def _offloaded_names(dtype: str, a_shape, b_shape, backend: str) -> list[str]:
    chooser = GemmChooser(backend, ChoiceCache() if backend == "auto" else None)
    mod, _ = _offload(_matmul_module(dtype, a_shape, b_shape), chooser)
    return [str(c.args[0].global_symbol) for c in _calls(mod["main"])]


def _calls(func: relax.Function) -> list[relax.Call]:
    return [b.value for blk in func.body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and str(b.value.op.name) == "relax.call_pure_packed"]


@pytest.mark.skipif("onednn" not in BACKENDS, reason="torch build without oneDNN")
@pytest.mark.parametrize("faster", ["onednn", "torch"])
def test_auto_backend_follows_the_measurement(faster, monkeypatch, tmp_path):
    """``auto`` takes whichever library the timing says is faster (a fake timer here: the real
    one is tested in test_gemm_choice); float64 and batched right operands have one candidate."""
    from tvmbridge.backend import gemm_choice

    monkeypatch.setenv("TVMBRIDGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_choice, "time_gemms", lambda p, libs: {lib: 1.0 if lib == faster else 2.0 for lib in libs})
    assert _offloaded_names("float32", (4, 8), (8, 3), "auto") == [f"tvmbridge.{faster}_matmul_nn"]
    assert _offloaded_names("float64", (4, 8), (8, 3), "auto") == ["tvmbridge.torch_matmul_nn"]
    assert _offloaded_names("float32", (2, 4, 8), (2, 8, 3), "auto") == ["tvmbridge.torch_matmul_nn"]
    assert _offloaded_names("float32", (4, 8), (8, 3), "torch") == ["tvmbridge.torch_matmul_nn"]


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown matmul backend"):
        _offloaded_names("float32", (4, 8), (8, 3), "cublas")


class RefusingChooser(GemmChooser):
    """A chooser that fails the test if anything asks it to decide or measure."""

    def __init__(self) -> None:
        super().__init__("auto", None, timer=self.refuse)

    def choose(self, problem):
        raise AssertionError(f"asked to choose {problem.key}")

    @staticmethod
    def refuse(problem, libraries):
        raise AssertionError(f"asked to time {problem.key}")


def _linear_module() -> tvm.IRModule:
    """``x @ W.T + b`` with a symbolic batch, and the same GEMM again: a transpose folded into a
    flag, a bias folded into addmm, a symbolic dim, a repeated site."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x, w = relax.Var("x", relax.TensorType((n, 16), "float32")), relax.Var("w", relax.TensorType((8, 16), "float32"))
    b = relax.Var("b", relax.TensorType((8,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            wt = bb.emit(relax.op.permute_dims(w, [1, 0]))
            y = bb.emit(relax.op.add(relax.op.matmul(x, wt), b))
            z = bb.emit(relax.op.matmul(x, wt))
            out = bb.emit_output(relax.op.add(y, z))
        bb.emit_func_output(out)
    return bb.get()


def test_applying_a_plan_is_pure(monkeypatch, tmp_path):
    """The same plan applied twice to the same module gives structurally equal modules, without
    measuring (the chooser and the timer refuse), without touching a cache, input unchanged."""
    from tvmbridge.backend import gemm_choice

    mod = _linear_module()
    before = mod.script()
    timer_calls = []
    chooser = GemmChooser("auto", ChoiceCache(tmp_path / "c.json"), lambda p, libs: timer_calls.append(p) or
                          {lib: 1.0 if lib == "torch" else 2.0 for lib in libs})
    _, plan = _offload(mod, chooser, {"n": 4})
    assert len(timer_calls) <= 1  # one distinct GEMM (none measured with a single candidate)
    monkeypatch.setattr(gemm_choice, "time_gemms", RefusingChooser.refuse)
    monkeypatch.setattr(gemm_choice.GemmChooser, "choose", RefusingChooser.choose)
    monkeypatch.setenv("TVMBRIDGE_CACHE_DIR", str(tmp_path / "never"))
    first, second = ApplyOffloadPlan(plan)(mod), ApplyOffloadPlan(plan)(mod)
    tvm.ir.assert_structural_equal(first, second)
    assert mod.script() == before and not (tmp_path / "never").exists()
    script = first.script()
    assert "R.matmul" not in script and "torch_addmm_nt" in script and "torch_matmul_nt" in script


def test_plan_is_a_value_with_the_decisions():
    """The plan: one entry per matmul in program order, immutable, the chooser's decisions in it
    (the repeated GEMM was decided once); a matmul the plan does not know is refused."""
    import dataclasses

    mod = _linear_module()
    _, plan = _offload(mod, GemmChooser("torch"), {"n": 4})
    assert [g.library for g in plan.gemms] == ["torch", "torch"]
    assert plan.gemms[0].site == plan.gemms[1].site and plan.gemms[0].site.trans_b
    assert len(plan.decisions) == 2 and plan.decisions[0] is plan.decisions[1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.gemms = ()
    unsized = plan_offload(mod, {}, {})  # the batch unknown: torch, undecided
    assert [g.reason for g in unsized.gemms] == ["a dim unknown at this compile's sizes"] * 2 and not unsized.decisions
    with pytest.raises(ValueError, match="no library for the matmul"):
        ApplyOffloadPlan(OffloadPlan())(mod)
