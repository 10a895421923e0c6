"""The GEMM packed functions the offload pass calls, checked one by one against float64 torch:
every transpose flag, with and without bias, on both backends, plus the backend choice."""
from __future__ import annotations

import itertools

import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax

from tvmbridge.backend.offload import OffloadMatmuls
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


def _offloaded_names(dtype: str, a_shape, b_shape, backend: str) -> list[str]:
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", relax.TensorType(a_shape, dtype)), relax.Var("y", relax.TensorType(b_shape, dtype))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, y))
        bb.emit_func_output(out)
    mod = OffloadMatmuls(backend)(bb.get())
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
