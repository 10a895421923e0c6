"""A widening cast read by several kernels is computed in each: no widened copy written out."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmbridge.backend.build import lower
from tvmbridge.backend.cast_per_consumer import CastPerConsumer


def _module(source: str, target: str, packed_consumer: bool = False, cast_is_output: bool = False) -> tvm.IRModule:
    """``c = astype(x)`` read by a sum and a product (and, optionally, a library call), returned
    with them (and, optionally, ``c`` itself)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 16), source))
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(relax.op.astype(x, target))
            total = bb.emit(relax.op.sum(c, axis=[0]))
            product = bb.emit(relax.op.multiply(c, c))
            outs = [total, product]
            if packed_consumer:
                outs.append(bb.emit(relax.call_pure_packed("test.identity", c, ty_args=c.ty)))
            if cast_is_output:
                outs.append(c)
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _casts(mod: tvm.IRModule) -> int:
    bindings = mod["main"].body.blocks[0].bindings
    return sum(isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.astype" for b in bindings)


def _written(mod: tvm.IRModule) -> list[tuple[tuple[int, ...], str]]:
    """Shape and dtype of every tensor the lowered ``main`` binds (what its kernels write out)."""
    out = []
    for b in mod["main"].body.blocks[0].bindings:
        ty = b.var.ty
        if isinstance(ty, relax.TensorType):
            out.append((tuple(int(s) for s in ty.shape), str(ty.dtype)))
    return out


def test_a_widening_cast_goes_into_each_fusable_consumer() -> None:
    mod = CastPerConsumer(_module("float32", "float64"))
    assert _casts(mod) == 3  # the shared one (now dead) and one per consumer
    lowered = lower(_module("float32", "float64"), tvm.target.Target("llvm"))
    assert ((8, 16), "float64") in _written(lowered)  # the product itself
    assert _written(lowered).count(((8, 16), "float64")) == 1  # but no widened copy of x


def test_the_lowered_module_computes_the_same() -> None:
    target = tvm.target.Target("llvm")
    x = np.random.default_rng(0).standard_normal((8, 16)).astype("float32")
    with target:
        exe = tvm.compile(lower(_module("float32", "float64"), target), target=target)
    total, product = (o.numpy() for o in relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x)))
    wide = x.astype("float64")
    np.testing.assert_allclose(total, wide.sum(axis=0), rtol=1e-12)  # the order of the sum may differ
    np.testing.assert_array_equal(product, wide * wide)


def test_a_narrowing_cast_stays_shared() -> None:
    mod = _module("float64", "float32")
    assert _casts(CastPerConsumer(mod)) == 1


def test_library_calls_and_outputs_keep_the_shared_cast() -> None:
    mod = CastPerConsumer(_module("float32", "float64", packed_consumer=True, cast_is_output=True))
    bindings = mod["main"].body.blocks[0].bindings
    shared = bindings[0].var
    packed = next(b.value for b in bindings if getattr(b.value.op, "name", "") == "relax.call_pure_packed")
    assert packed.args[1].same_as(shared)  # the library call reads the one cast
    assert any(f.same_as(shared) for f in bindings[-1].value.fields)  # and so does the output
    assert _casts(mod) == 3


def _expression_module(source: str) -> tvm.IRModule:
    """BatchNorm's backward form: ``p = astype(g) * (astype(x) - mean)`` (``mean`` a per-column
    float64 operand), read by a sum and by an elementwise product."""
    bb = relax.BlockBuilder()
    g = relax.Var("g", relax.TensorType((8, 16), source))
    x = relax.Var("x", relax.TensorType((8, 16), source))
    mean = relax.Var("mean", relax.TensorType((1, 16), "float64"))
    with bb.function("main", [g, x, mean]):
        with bb.dataflow():
            centered = bb.emit(relax.op.subtract(relax.op.astype(x, "float64"), mean))
            p = bb.emit(relax.op.multiply(relax.op.astype(g, "float64"), centered))
            total = bb.emit(relax.op.sum(p, axis=[0]))
            scaled = bb.emit(relax.op.multiply(p, mean))
            out = bb.emit_output(relax.Tuple([total, scaled]))
        bb.emit_func_output(out)
    return bb.get()


def test_arithmetic_on_widened_values_goes_into_each_consumer_too() -> None:
    target = tvm.target.Target("llvm")
    lowered = lower(_expression_module("float32"), target)
    assert _written(lowered).count(((8, 16), "float64")) == 1  # the scaled output only, not p
    rng = np.random.default_rng(1)
    g, x = (rng.standard_normal((8, 16)).astype("float32") for _ in range(2))
    mean = rng.standard_normal((1, 16))
    with target:
        exe = tvm.compile(lowered, target=target)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    total, scaled = (o.numpy() for o in vm["main"](*(tvm.runtime.tensor(a) for a in (g, x, mean))))
    p = g.astype("float64") * (x.astype("float64") - mean)
    np.testing.assert_allclose(total, p.sum(axis=0), rtol=1e-12)
    np.testing.assert_array_equal(scaled, p * mean)


def test_arithmetic_on_values_already_wide_stays_shared() -> None:
    """float64 inputs: nothing is widened, the product is written once and read twice."""
    lowered = lower(_expression_module("float64"), tvm.target.Target("llvm"))
    assert _written(lowered).count(((8, 16), "float64")) == 2
