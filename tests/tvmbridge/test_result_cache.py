"""The disk caches of compile results (``pipeline/result_cache.py``) and of traces
(``frontend/trace_cache.py``): a second compile of an equal graph skips the decomposition and the
stages between trace and build, with PyTorch's numbers (dropout masks, random ops and buffer
updates included); what those stages read is in the keys; a damaged entry compiles again; the
stored TVM objects come back as one graph (vars shared between the halves and the joint graph stay
shared)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import tvm
import tvm_ffi

from tests.helpers import clone_module, max_errors, run_step
from tvmbridge.caches import CACHES
from tvmbridge.errors import ConversionError
from tvmbridge.frontend.digest import program_digest
from tvmbridge.frontend.export import Deferred
from tvmbridge.frontend.trace_cache import TraceCache, TraceFacts, cached_trace
from tvmbridge.pipeline import result_cache
from tvmbridge.runtime.compiled import compile_training
from tvmbridge.runtime.dispatch import add_tvm_dispatch, dispatcher_of


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TVMBRIDGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TVMBRIDGE_DISK_CACHE", "1")
    return tmp_path / "compiles"


class Noisy(torch.nn.Module):
    """Dropout (a mask from PyTorch's RNG), a random op, a running statistic: every kind of
    artifact the skipped stages make."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.25)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.norm(self.a(x)))
        return self.b(torch.nn.functional.gelu(h) + 0.01 * torch.rand_like(h))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Noisy()


def _dispatched(model, x, **options):
    CACHES.clear()  # the process cache would answer first
    module = add_tvm_dispatch(clone_module(model), (x,), **options)
    return module, dispatcher_of(module).variants[0].compiled


def test_a_second_compile_loads_the_result_and_matches_pytorch(cache_dir):
    model, x = _model(), torch.randn(6, 8)
    first, compiled = _dispatched(model, x)
    assert not compiled.result_loaded and len(list(cache_dir.glob("*.pkl"))) == 1
    second, loaded = _dispatched(model, x)
    assert loaded.result_loaded and loaded.executable_loaded, "an equal graph compiled again"
    assert loaded.trace_loaded and isinstance(loaded.traced.program, Deferred), "decomposed again"
    assert loaded.traced.graph_digest == compiled.traced.graph_digest
    with pytest.raises(RuntimeError, match="keeps no decomposed program"):  # released: holds no module
        loaded.traced.exported
    assert "split and offload loaded from the disk cache" in loaded.summary()
    assert "gradient" not in loaded.compile_seconds  # the stages did not run
    assert len(loaded.random_sites) == len(compiled.random_sites) == 2
    assert loaded.split.captures == compiled.split.captures
    eager = clone_module(model)
    expected = run_step(eager, (x,))
    for module in (first, second):
        errs = max_errors(run_step(module, (x,)), expected)
        assert max(errs.values()) < 1e-5, errs
    for name in ("running_mean", "running_var"):  # the buffer update runs in the loaded code too
        assert torch.allclose(getattr(second.norm, name), getattr(eager.norm, name), atol=1e-6)


def test_stored_objects_come_back_as_one_graph(cache_dir):
    model, x = _model(), torch.randn(6, 8)
    CACHES.clear()
    compiled = compile_training(model, (x,), disk_cache=False)
    from tvmbridge.pipeline.artifacts import Artifacts

    artifacts = Artifacts(
        module=model,
        args=(x,),
        kwargs={},
        options=compiled.options,
        random_sites=tuple(compiled.random_sites),
        num_index_checks=compiled.num_index_checks,
        grad_param_indices=tuple(compiled.grad_param_indices),
        split=compiled.split,
        halves=compiled.stages["fast_math"],
        gemm_choices=compiled.gemm_choices,
        gradient=None,
    )
    back = result_cache.loads(result_cache.dumps(result_cache.entry_of(artifacts)))
    assert tvm_ffi.structural_equal(back["halves"], artifacts.halves)
    split = back["split"]
    assert tvm_ffi.structural_equal(split.forward, compiled.split.forward)
    assert tvm_ffi.structural_equal(split.backward, compiled.split.backward)
    # the joint graph's keys are the loaded forward's own vars, not copies of them
    forward_vars = {b.var for block in split.forward.body.blocks for b in block.bindings}
    assert forward_vars and sum(v in split.joint.keys for v in forward_vars) > len(forward_vars) // 2
    assert back["random_sites"] == artifacts.random_sites  # torch ops and dtypes by name


def test_what_the_skipped_stages_read_is_in_the_key(cache_dir):
    model, x = _model(), torch.randn(6, 8)
    _dispatched(model, x)
    frozen = clone_module(model)
    frozen.a.weight.requires_grad_(False)  # another gradient
    CACHES.clear()
    assert not add_tvm_dispatch(frozen, (x,))._tvm_dispatch.variants[0].compiled.result_loaded
    wide = torch.randn(8, 6).t()  # another layout of the input: the masks' strides differ
    _, compiled = _dispatched(model, wide)
    assert not compiled.result_loaded
    _, compiled = _dispatched(model, x, fast_math=False)
    assert not compiled.result_loaded
    _, compiled = _dispatched(model, x)
    assert compiled.result_loaded


def test_kernel_checks_asked_for_are_never_answered_by_an_unchecked_library(cache_dir, monkeypatch):
    """``TVMBRIDGE_KERNEL_ASSERTS=1`` after a normal run: the stored compile result's build key
    names the unchecked library, so the setting must be in the result's key too."""
    from tvmbridge.backend.codegen import kernel_asserts

    model, x = _model(), torch.randn(6, 8)
    _, plain = _dispatched(model, x)
    monkeypatch.setenv("TVMBRIDGE_KERNEL_ASSERTS", "1")
    assert kernel_asserts()
    _, checked = _dispatched(model, x)
    assert not checked.result_loaded and not checked.executable_loaded
    _, again = _dispatched(model, x)
    assert again.result_loaded and again.executable_loaded
    monkeypatch.delenv("TVMBRIDGE_KERNEL_ASSERTS")
    _, unchecked = _dispatched(model, x)
    assert unchecked.result_loaded and unchecked.executable_loaded


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_result_is_compiled_again(cache_dir, damage):
    model, x = _model(), torch.randn(6, 8)
    _dispatched(model, x)
    (entry,) = cache_dir.glob("*.pkl")
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\0" * 64 + data[64:])
    with pytest.warns(UserWarning, match="damaged"):
        module, compiled = _dispatched(model, x)
    assert not compiled.result_loaded
    errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < 1e-5, errs
    assert _dispatched(model, x)[1].result_loaded  # stored again, whole


def test_a_record_naming_a_file_of_other_fields_is_refused(cache_dir):
    """A payload whose digest matches but that holds something else (an older layout under the
    same key) is damage, not a result."""
    data = pickle.dumps({"other": 1})
    objects = tvm.ir.save_json(tvm.runtime.convert([])).encode()
    cache = result_cache.ResultCache(cache_dir)
    cache.write = lambda value, path: Path(path).write_bytes(len(data).to_bytes(8, "little") + data + objects)  # type: ignore[method-assign]
    assert cache.store("e" * 64, None)
    with pytest.warns(UserWarning, match="damaged"):
        assert result_cache.ResultCache(cache_dir).load("e" * 64) is None
    assert not os.path.exists(cache_dir / ("e" * 64 + ".json"))


def test_a_loaded_trace_decomposes_when_a_later_stage_reads_the_graph(cache_dir):
    """Trace facts from the cache, the compile result not (other options): the convert stage
    reads the program, which is decomposed then, and the compile is PyTorch's."""
    model, x = _model(), torch.randn(6, 8)
    _dispatched(model, x)
    module, compiled = _dispatched(model, x, fast_math=False)
    assert compiled.trace_loaded and not compiled.result_loaded
    assert program_digest(compiled.traced.exported) == compiled.traced.graph_digest
    errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < 1e-5, errs


class WritesInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        count.add_(1)
        return self.lin(x) * 2


def test_the_trace_key_covers_what_the_trace_checks(cache_dir):
    """Writing into an input that requires grad is refused by the trace; a cached trace of the
    same call without grad must not let it through."""
    torch.manual_seed(0)
    model, x, count = WritesInput(), torch.randn(3, 4), torch.zeros(3, 4)
    CACHES.clear()
    assert not compile_training(model, (x, count)).trace_loaded
    CACHES.clear()
    assert compile_training(model, (x, count)).trace_loaded
    CACHES.clear()
    with pytest.raises(ConversionError, match="requires grad"):
        compile_training(model, (x, count.clone().requires_grad_()))


def test_facts_of_another_program_are_an_error_not_a_compile(cache_dir):
    model, x = _model(), torch.randn(6, 8)
    cache = TraceCache()
    traced, loaded = cached_trace(model, (x,), {}, None, cache)
    assert not loaded
    (record,) = (cache_dir.parent / "traces").glob("*.json")
    wrong = TraceFacts.of(traced).__dict__ | {"graph_digest": "0" * 64}
    assert cache.store(record.stem, TraceFacts(**wrong))
    again, loaded = cached_trace(model, (x,), {}, None, cache)
    assert loaded and again.num_user_outputs == traced.num_user_outputs
    with pytest.raises(RuntimeError, match="described another program"):
        again.exported
    assert not record.exists()  # the entry went with it
    with pytest.raises(RuntimeError, match="described another program"):  # kept, not retried
        again.exported


class DefaultDtype(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.arange(4.0)  # the default dtype: nowhere in the graph's code


def test_the_default_dtype_is_in_the_keys(cache_dir):
    torch.manual_seed(0)
    model, x = DefaultDtype(), torch.randn(3, 4)
    CACHES.clear()
    assert compile_training(model, (x,)).traced.graph_digest
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        module, compiled = _dispatched(model, x)
        assert not compiled.trace_loaded and not compiled.result_loaded
        out = module(x)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, clone_module(model)(x))
    finally:
        torch.set_default_dtype(before)


def test_options_holding_callables_keep_no_compile_result(cache_dir):
    """A callable's code is in no key: its compile is not stored (nor loaded), and equal
    options without it are another key."""
    from tvmbridge.partition.policy import capture_all

    model, x = _model(), torch.randn(6, 8)
    _, compiled = _dispatched(model, x, capture=capture_all)
    assert not compiled.result_loaded and not list(cache_dir.glob("*.pkl"))
    _, compiled = _dispatched(model, x, capture=capture_all)
    assert not compiled.result_loaded and compiled.trace_loaded  # the trace reads no option
    _, compiled = _dispatched(model, x, verbose=True, verify=False)  # options the compile does not read
    assert not compiled.result_loaded
    _, compiled = _dispatched(model, x)
    assert compiled.result_loaded
