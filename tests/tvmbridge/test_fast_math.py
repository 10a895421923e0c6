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
