"""The float32 fast-math rewrite: one kernel per op, shape and attributes, and still the right one."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmbridge.backend.fast_math import FastMathFloat32


def _module() -> tvm.IRModule:
    """Five ``tanh`` of one shape, one of another, and ``softmax`` over each axis of a square."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((6, 6), "float32"))
    y = relax.Var("y", relax.TensorType((3, 6), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            h = x
            for _ in range(5):
                h = bb.emit(relax.op.tanh(h))
            other = bb.emit(relax.op.tanh(y))
            rows = bb.emit(relax.op.nn.softmax(h, axis=1))
            cols = bb.emit(relax.op.nn.softmax(h, axis=0))
            out = bb.emit_output(relax.Tuple([rows, cols, other]))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule) -> list[str]:
    return sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))


def test_one_kernel_per_op_shape_and_attributes() -> None:
    kernels = _kernels(FastMathFloat32(_module()))
    assert sum(k.startswith("fast_tanh") for k in kernels) == 2  # (6, 6) and (3, 6)
    assert sum(k.startswith("fast_softmax") for k in kernels) == 2  # axis 1 and axis 0


def test_shared_kernels_compute_what_the_ops_do() -> None:
    mod = FastMathFloat32(_module())
    with tvm.target.Target("llvm"):
        exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 6)).astype("float32")
    y = rng.standard_normal((3, 6)).astype("float32")
    rows, cols, other = (o.numpy() for o in vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y)))
    h = x
    for _ in range(5):
        h = np.tanh(h)
    e = np.exp(h - h.max(axis=1, keepdims=True))
    np.testing.assert_allclose(rows, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    e = np.exp(h - h.max(axis=0, keepdims=True))
    np.testing.assert_allclose(cols, e / e.sum(axis=0, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(other, np.tanh(y), rtol=1e-5, atol=1e-6)


def test_sigmoid_is_the_fast_kernel_and_matches_pytorch() -> None:
    """float32 ``sigmoid`` (a SiLU's) runs ``1 / (1 + fast_exp(-x))``: within a few float32 ulps of
    ATen's over the range where it is neither 0 nor 1, the same at the extremes and NaN, and
    the SiLU gradient with it."""
    import torch

    from tvmbridge import add_tvm_dispatch

    class Act(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.sigmoid(x), torch.nn.functional.silu(x)

    special = [float("nan"), -float("inf"), float("inf"), -100.0, -20.0, 0.0, 20.0, 100.0]
    x = torch.cat([torch.linspace(-30, 30, 4001), torch.tensor(special)]).reshape(1, -1).requires_grad_(True)
    m = Act()
    add_tvm_dispatch(m, (x,), verify=False)
    kernels = [gv.name_hint for gv in m._tvm_dispatch.compiled.stages["fast_math"].get_global_vars()]
    assert any("sigmoid_fast" in k for k in kernels)
    (s, silu), (rs, rsilu) = m(x), Act()(x)
    finite = rs.isfinite() & (rs > 1e-30)
    torch.testing.assert_close(s[finite], rs[finite], rtol=2e-6, atol=0)
    assert s[:, -8].isnan().all()
    torch.testing.assert_close(s[:, -7:], rs[:, -7:], rtol=2e-6, atol=1e-30)  # sigmoid(-100): 0 here, 4e-44 in ATen
    (g,) = torch.autograd.grad(silu[:, :-8].sum(), x)
    (rg,) = torch.autograd.grad(rsilu[:, :-8].sum(), x)
    torch.testing.assert_close(g[:, :-8], rg[:, :-8], rtol=2e-6, atol=1e-7)
