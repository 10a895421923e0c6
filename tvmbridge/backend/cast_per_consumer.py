"""A cast read by several kernels, computed in each of them instead of written out once.

``FuseOps`` fuses a value into its consumers only when all of them fall in one group: a value read
by two kernels is written out whole and read back by both. Casts are where that costs most: a
train-mode BatchNorm sums its float32 input in float64 (as ATen's CPU kernel accumulates), and the
float64 copy is read by the sum and again by the normalization, so every BatchNorm wrote and read
a tensor twice the size of its input (a standalone ``cast`` kernel per BatchNorm, forward and
backward). Each fusable consumer now gets its own cast of the source, which ``FuseOps`` fuses into
it; the cast costs one instruction per element where the copy cost its bytes three times. A
consumer that cannot fuse (a library call: an offloaded GEMM or convolution) and a function output
keep the one shared cast. Run before legalization, on the Relax ops themselves.

The same holds one level up: arithmetic on widened values (BatchNorm's backward computes
``grad * (x - mean)`` in float64, read by a sum and by the input gradient) is a float64 tensor
written out whole. Such an expression (``add``, ``subtract``, ``multiply``, ``divide``,
``negative`` over widening casts and broadcast operands, at most :data:`MAX_DEPTH` deep, wider
than every full-size tensor it reads) is bound again, with its casts, before each fusable
consumer; broadcast operands (a per-channel mean) stay shared.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

from ..ir import static_shape, with_vars

_ARITHMETIC = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.negative"}
_WIDENING_OPS = _ARITHMETIC | {"relax.astype"}
_LEAVES = (tvm.ir.expr.Constant, relax.ShapeExpr, tvm.ir.expr.StringImm)  # arguments that read no variable
MAX_DEPTH = 3  # operations in a recomputed expression, counted along its longest path
_UNFUSABLE_PREFIX = "relax.call_"  # call_tir, call_pure_packed, call_dps_packed: kernels already, or library calls


def _fusable(value: relax.Expr) -> bool:
    """A Relax operator call that legalization turns into a kernel ``FuseOps`` may fuse a cast into."""
    return (
        isinstance(value, relax.Call)
        and isinstance(value.op, tvm.ir.Op)
        and value.op.name.startswith("relax.")
        and not value.op.name.startswith(_UNFUSABLE_PREFIX)
    )


def _widens(cast: relax.Call) -> bool:
    """A cast to a type at least as wide as its source: each consumer then reads the narrower
    source. A narrowing cast stays shared (its consumers would read the wider source instead:
    a float64 BatchNorm output read as float64 by both the activation and its gradient)."""
    source = cast.args[0].ty
    return (
        isinstance(source, relax.TensorType)
        and source.dtype is not None
        and (tvm.DataType(str(cast.ty.dtype)).bits >= tvm.DataType(str(source.dtype)).bits)
    )


def _bits(ty: relax.StructInfo) -> int | None:
    dtype = getattr(ty, "dtype", None)
    return None if dtype is None or str(dtype) == "" else tvm.DataType(str(dtype)).bits


def _numel(var: relax.Expr, sizes: dict[relax.Expr, int | None]) -> int | None:
    """Elements of a static-shaped tensor, else None; memoized in ``sizes`` (reading a shape
    through the FFI, element by element, was most of the pass's time)."""
    if var not in sizes:
        shape = static_shape(var)
        sizes[var] = None if shape is None else math.prod(shape)
    return sizes[var]


def _broadcast_operand(arg: relax.Expr, size: int, sizes: dict[relax.Expr, int | None]) -> bool:
    """A constant, or a tensor smaller than the result (read by every element: computed once)."""
    if isinstance(arg, tvm.ir.expr.Constant):
        return True
    n = _numel(arg, sizes)
    return n is not None and n < size


def _op_name(value: relax.Expr) -> str:
    """The operator a binding calls (``""`` for anything else)."""
    op = value.op if isinstance(value, relax.Call) else None
    return op.name if isinstance(op, tvm.ir.Op) else ""


def _source_bits(
    var: relax.Var, bound: dict[relax.Var, relax.Expr], depth: int, sizes: dict[relax.Expr, int | None]
) -> int | None:
    """The widest dtype (bits) of the full-size tensors ``var`` is computed from, where ``var`` is
    a widening cast or arithmetic over such values and broadcast operands; else None."""
    value = bound.get(var)
    if value is None:
        return None
    name = _op_name(value)
    if name == "relax.astype":
        return _bits(value.args[0].ty) if _widens(value) else None
    if depth == 0 or name not in _ARITHMETIC:
        return None
    size = _numel(var, sizes)
    if size is None:
        return None
    widest = 0
    for arg in value.args:
        if _broadcast_operand(arg, size, sizes):
            continue
        bits = _source_bits(arg, bound, depth - 1, sizes) if isinstance(arg, relax.Var) else None
        if bits is None:
            return None
        widest = max(widest, bits)
    out = _bits(var.ty)
    return widest if out is not None and widest < out else None


def _read_vars(value: relax.Expr) -> list[relax.Var]:
    """The variables a binding reads, each once. A call in normal form reads variables, tuples of
    them and constants, read here directly: a free-variable analysis per binding was most of the
    pass's time. Anything else goes to that analysis."""
    if not isinstance(value, relax.Call):
        return list(dict.fromkeys(relax.analysis.free_vars(value)))
    found: list[relax.Var] = []
    for arg in value.args:
        for leaf in arg.fields if isinstance(arg, relax.Tuple) else [arg]:
            if isinstance(leaf, relax.Var):
                found.append(leaf)
            elif not isinstance(leaf, _LEAVES):
                return list(dict.fromkeys(relax.analysis.free_vars(value)))
    return list(dict.fromkeys(found))


def _shared_widenings(block: relax.DataflowBlock, sizes: dict[relax.Expr, int | None]) -> set[relax.Var]:
    """Widened values (casts, and arithmetic over them: :func:`_source_bits`) bound in ``block``
    that are read by more than one binding (or by one and the block's outputs) and by at least one
    that can fuse them."""
    bound = {b.var: b.value for b in block.bindings}
    candidates = [v for v, value in bound.items() if _op_name(value) in _WIDENING_OPS]
    widened = {v for v in candidates if _source_bits(v, bound, MAX_DEPTH, sizes) is not None}
    if not widened:
        return set()
    readers: dict[relax.Var, list[relax.Expr]] = {v: [] for v in widened}
    for b in block.bindings:
        for var in _read_vars(b.value):
            if var in readers:
                readers[var].append(b.value)
    outputs = {b.var for b in block.bindings if not isinstance(b.var, relax.DataflowVar)}
    return {
        v
        for v, values in readers.items()
        if any(_fusable(x) for x in values) and (len(values) > 1 or (values and v in outputs))
    }


def _bind_again(
    var: relax.Var,
    bound: dict[relax.Var, relax.Expr],
    into: list[relax.Binding],
    depth: int,
    sizes: dict[relax.Expr, int | None],
) -> relax.Var:
    """A fresh binding of ``var``'s widening expression (its casts and arithmetic, not its
    broadcast operands), appended to ``into``; the fresh variable."""
    value = bound[var]
    if _op_name(value) != "relax.astype":
        size = _numel(var, sizes)
        assert size is not None and isinstance(value, relax.Call) and depth > 0  # as _source_bits checked
        args = [
            a if _broadcast_operand(a, size, sizes) else _bind_again(a, bound, into, depth - 1, sizes)
            for a in value.args
        ]
        value = relax.Call(value.op, args, value.attrs, value.ty_args)
    fresh = relax.DataflowVar(f"{var.name}_here", var.ty)
    into.append(relax.VarBinding(fresh, value))
    return fresh


def cast_per_consumer(func: relax.Function) -> relax.Function:
    """``func`` with each shared widened value (:func:`_shared_widenings`) bound again before each
    fusable consumer; the original binding stays for the others (dead code where there are none)."""
    body = func.body
    if (
        not isinstance(body, relax.SeqExpr)
        or len(body.blocks) != 1
        or not isinstance(body.blocks[0], relax.DataflowBlock)
    ):
        return func
    block = body.blocks[0]
    sizes: dict[relax.Expr, int | None] = {}
    shared = _shared_widenings(block, sizes)
    if not shared:
        return func
    bound = {b.var: b.value for b in block.bindings}
    bindings: list[relax.Binding] = []
    for b in block.bindings:
        value = b.value
        if _fusable(value):
            for var in [v for v in _read_vars(value) if v in shared]:
                value = with_vars(value, {var: _bind_again(var, bound, bindings, MAX_DEPTH, sizes)})
        bindings.append(b if value.same_as(b.value) else relax.VarBinding(b.var, value))
    new_body = relax.SeqExpr([relax.DataflowBlock(bindings)], body.body)
    return relax.Function(func.params, new_body, func.ret_ty, func.is_pure, func.attrs, func.span)


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.CastPerConsumer")
def CastPerConsumer(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """:func:`cast_per_consumer` on every Relax function."""
    out = mod.clone()
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            new = cast_per_consumer(func)
            if not new.same_as(func):
                out[gv] = new
    return out
