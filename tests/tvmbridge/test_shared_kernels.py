"""Kernels that differ only in their sizes share one kernel over symbolic sizes
(``backend/shared_kernels``): fewer kernels to build, each call still computing what its own
kernel computed; what cannot be shared exactly (a constant that is no size, index arithmetic
over sizes, symbolic or large kernels) keeps its kernels."""
from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm import relax, tirx

from tvmbridge import add_tvm_dispatch, devices
from tvmbridge.backend import build, shared_kernels

from ..helpers import clone_module, is_tvm, max_errors, run_step

TARGET = tvm.target.Target({**dict(devices.target_for(torch.device("cpu")).export()), "num-cores": 4})
_BUILDER: list[relax.BlockBuilder] = []


def _module(shapes: list[tuple], body, dtype: str = "float32") -> tvm.IRModule:
    """``main(x0, x1, ...)`` returning ``body(i, xi)`` for each input (``body`` may emit its
    intermediate values with ``_BUILDER[0].emit``)."""
    bb = relax.BlockBuilder()
    _BUILDER[:] = [bb]
    xs = [relax.Var(f"x{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            outs = [bb.emit(body(i, x)) for i, x in enumerate(xs)]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule) -> list[tirx.PrimFunc]:
    lowered = build.lower(mod, TARGET)
    return [f for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc)]


def _run(mod: tvm.IRModule, xs: list[np.ndarray]) -> list[np.ndarray]:
    vm = build.load(build.compile_module(mod, TARGET), torch.device("cpu"))
    return [o.numpy() for o in vm["main"](*[tvm.runtime.tensor(x) for x in xs])]


def _x(shape, seed=0, dtype="float32"):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _silu_plus_one(_, x):
    return relax.op.add(relax.op.multiply(relax.op.sigmoid(x), x), relax.const(1.0, "float32"))


def test_kernels_that_differ_only_in_sizes_become_one_that_computes_what_each_did(monkeypatch):
    shapes = [(2, 8, 4, 4), (2, 16, 2, 2), (2, 24, 3, 5), (3, 5)]
    mod = _module(shapes, _silu_plus_one)
    shared = _kernels(mod)
    assert len(shared) == 2  # the three 4-d kernels are one; the 2-d one is other code
    assert any(not all(isinstance(d, tirx.IntImm) for d in f.params[0].shape) for f in shared)
    xs = [_x(s, i) for i, s in enumerate(shapes)]
    for got, x in zip(_run(mod, xs), xs):
        np.testing.assert_allclose(got, x / (1 + np.exp(-x)) + 1, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(shared_kernels, "MAX_SHARED_ELEMENTS", 0)
    assert len(_kernels(mod)) == 4


def test_a_shared_reduction_reduces_over_each_call_s_own_extent():
    shapes = [(4, 8, 16), (6, 16, 16), (3, 32, 16)]
    mod = _module(shapes, lambda _, x: relax.op.sum(relax.op.multiply(x, x), axis=[1], keepdims=True))
    assert len(_kernels(mod)) == 1
    xs = [_x(s, i) for i, s in enumerate(shapes)]
    for got, x in zip(_run(mod, xs), xs):
        np.testing.assert_allclose(got, (x * x).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_a_constant_that_is_no_size_keeps_its_kernels():
    """The same code adding 3 and 5 to tensors of one shape: no size tells the two apart."""
    mod = _module([(7,), (7,)], lambda i, x: relax.op.add(x, relax.const(3 + 2 * i, "int64")), dtype="int64")
    assert len(_kernels(mod)) == 2
    xs = [np.arange(7, dtype="int64"), np.arange(7, dtype="int64") * 2]
    got = _run(mod, xs)
    np.testing.assert_array_equal(got[0], xs[0] + 3)
    np.testing.assert_array_equal(got[1], xs[1] + 5)


def test_index_arithmetic_over_sizes_keeps_its_kernels():
    """A transpose read through a reshape divides its index by a size: shared, the division would
    be by a variable (slow to simplify, slow to run), so each size keeps its kernel. (Transposing
    ``(2, 3, n)`` instead, the simplifier writes the index over the constant 3, and that is shared.)"""
    shapes = [(2, 6, 4), (2, 10, 4)]

    def body(_, x):
        scaled = _BUILDER[0].emit(relax.op.multiply(x, relax.const(2.0, "float32")))
        flat = relax.op.reshape(scaled, (x.ty.shape[1], 8))  # (2, c, 4) as (c, 8): index // (4 c)
        return relax.op.add(_BUILDER[0].emit(flat), relax.const(1.0, "float32"))

    mod = _module(shapes, body)
    kernels = _kernels(mod)
    assert all(all(isinstance(d, tirx.IntImm) for p in f.params for d in p.shape) for f in kernels)
    xs = [_x(s, i) for i, s in enumerate(shapes)]
    for got, x in zip(_run(mod, xs), xs):
        np.testing.assert_allclose(got, (2 * x).reshape(-1, 8) + 1, rtol=1e-6)

    def batch_body(_, x):
        flat = relax.op.reshape(_BUILDER[0].emit(relax.op.permute_dims(x, [0, 2, 1])), (x.ty.shape[0], -1))
        return relax.op.add(_BUILDER[0].emit(flat), relax.const(1.0, "float32"))

    over_constant = [(2, 3, 6), (4, 3, 6)]  # index arithmetic over the constants 3 and 6 only
    mod = _module(over_constant, batch_body)
    assert len(_kernels(mod)) == 1
    xs = [_x(s, i) for i, s in enumerate(over_constant)]
    for got, x in zip(_run(mod, xs), xs):
        np.testing.assert_allclose(got, x.transpose(0, 2, 1).reshape(len(x), -1) + 1, rtol=1e-6)


def test_per_channel_statistics_viewed_for_broadcast_share_one_kernel():
    """BatchNorm's ``(C,)`` scale viewed as ``(1, C, 1, 1)`` and multiplied in, at three widths:
    the legalized view reads ``index % C``, the identity at each static width, so the three are
    one kernel (with the remainder kept, the shared kernel would divide by a size variable)."""
    bb = relax.BlockBuilder()
    shapes = [(2, 8, 4, 4), (2, 16, 2, 2), (2, 24, 3, 5)]
    xs = [relax.Var(f"x{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    scales = [relax.Var(f"s{i}", relax.TensorType((s[1],), "float32")) for i, s in enumerate(shapes)]
    with bb.function("main", xs + scales):
        with bb.dataflow():
            outs = []
            for x, s, shape in zip(xs, scales, shapes):
                view = bb.emit(relax.op.reshape(s, (1, shape[1], 1, 1)))
                outs.append(bb.emit(relax.op.add(relax.op.multiply(x, view), relax.const(1.0, "float32"))))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    mod = bb.get()
    assert len(_kernels(mod)) == 1
    arrays = [_x(s, i) for i, s in enumerate(shapes)]
    stats = [_x((s[1],), 10 + i) for i, s in enumerate(shapes)]
    for got, x, s in zip(_run(mod, arrays + stats), arrays, stats):
        np.testing.assert_allclose(got, x * s.reshape(1, -1, 1, 1) + 1, rtol=1e-6)


def test_large_and_symbolic_kernels_are_left_as_they_are(monkeypatch):
    monkeypatch.setattr(shared_kernels, "MAX_SHARED_ELEMENTS", 100)
    big = _module([(8, 16), (8, 32)], _silu_plus_one)
    assert len(_kernels(big)) == 2
    n = tirx.Var("n", "int64")
    mixed = _module([(n, 8), (4, 8), (n, 8)], _silu_plus_one)
    xs = [_x((5, 8), 0), _x((4, 8), 1), _x((5, 8), 2)]
    for got, x in zip(_run(mixed, xs), xs):
        np.testing.assert_allclose(got, x / (1 + np.exp(-x)) + 1, rtol=1e-5, atol=1e-6)


class _Widths(torch.nn.Module):
    """The same block (conv, BatchNorm, SiLU, a residual) at three widths and resolutions, as a
    CNN's stages repeat theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList()
        for c in (4, 8, 12):
            self.blocks.append(torch.nn.Sequential(torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c)))
        self.widen = torch.nn.ModuleList([torch.nn.Conv2d(4, 8, 1, stride=2), torch.nn.Conv2d(8, 12, 1, stride=2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = torch.nn.functional.silu(block(x)) + x
            if i < len(self.widen):
                x = self.widen[i](x)
        return x.mean((2, 3))


def test_a_network_repeating_its_block_at_several_sizes_trains_as_pytorch_does():
    torch.manual_seed(0)
    module = _Widths().train()
    reference = clone_module(module)
    x = torch.randn(2, 4, 16, 16)
    add_tvm_dispatch(module, (x,))
    for step in range(2):
        got, want = run_step(module, (x + step,)), run_step(reference, (x + step,))
        assert is_tvm(got[0][0])
        errors = max_errors(got, want)
        assert max(errors.values()) < 1e-4, errors
    for name, buffer in reference.named_buffers():  # the running statistics, through two steps
        torch.testing.assert_close(dict(module.named_buffers())[name], buffer, rtol=1e-5, atol=1e-6)



def test_a_family_of_small_kernels_stays_serial_and_a_large_one_parallel():
    """A shared kernel's sizes are symbolic, but its members' are known: where the largest
    member's tensors are small (per-channel vectors), the kernel is serial as each member alone
    would be (a parallel launch costs more than its work); a family of large kernels is parallel."""
    for shapes, parallel in (([(2, 8), (2, 24), (2, 40)], False), ([(2, 16384), (3, 16384)], True)):
        mod = _module(shapes, _silu_plus_one)
        (kernel,) = _kernels(mod)
        assert not all(isinstance(d, tirx.IntImm) for d in kernel.params[0].shape)  # shared
        assert int(kernel.attrs[shared_kernels.LARGEST_TENSOR_ATTR]) == max(a * b for a, b in shapes)
        assert ("T.parallel" in kernel.script()) == parallel, kernel.script()
        xs = [_x(s, i) for i, s in enumerate(shapes)]
        for got, x in zip(_run(mod, xs), xs):
            np.testing.assert_allclose(got, x / (1 + np.exp(-x)) + 1, rtol=1e-5, atol=1e-6)
