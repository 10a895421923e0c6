"""Comparisons, arithmetic and reductions over ``bool`` tensors, through ``int32``.

PyTorch compares and adds boolean tensors (``mask > 0``, ``mask == True``, ``mask + mask``,
``mask.max()``: LongT5's local attention mask) as 0/1 values. Relax types them and legalizes
them, but TVM's LLVM code generation has no comparison or arithmetic of its ``bool`` type (it
asserts a float type, or fails LLVM's verifier, or has no ``min_value`` for a reduction's
identity): the whole compile failed. Here every such call reads its boolean operands cast to
``int32`` (or to the other operand's integer type) and, where PyTorch's result is boolean
(``mask + mask``, ``mask.max()``), casts the result back: the same values PyTorch computes.
Sorts, top-k and arg-extremes of 8- and 16-bit integers failed the same way (TVM's sort kernels
compare no narrower integer than int32): they read int32 too, their values cast back.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from ..ir import RewriteBindings

op = relax.op
COMPARISONS: dict[str, Callable] = {
    "relax.less": op.less,
    "relax.greater": op.greater,
    "relax.less_equal": op.less_equal,
    "relax.greater_equal": op.greater_equal,
    "relax.equal": op.equal,
    "relax.not_equal": op.not_equal,
}
ARITHMETIC: dict[str, Callable] = {
    "relax.add": op.add,
    "relax.subtract": op.subtract,
    "relax.multiply": op.multiply,
    "relax.maximum": op.maximum,
    "relax.minimum": op.minimum,
}
REDUCTIONS: dict[str, Callable] = {"relax.max": op.max, "relax.min": op.min}
# one input, attributes kept: the call again over int32 (the result cast back where it was bool)
SCANS = ("relax.argmax", "relax.argmin", "relax.sort", "relax.argsort")
# integer types TVM's sort and top-k kernels have no comparison for (``sort(int8)``): read as int32 too
NARROW = ("int8", "uint8", "int16", "uint16")


def _is_bool(expr: relax.Expr) -> bool:
    ty = getattr(expr, "ty", None)
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == "bool"


def _is_narrow(expr: relax.Expr) -> bool:
    ty = getattr(expr, "ty", None)
    return isinstance(ty, relax.TensorType) and str(ty.dtype) in ("bool", *NARROW)


def _ordered_as_int32(value: relax.Call) -> relax.Expr:
    """A sort, arg-extreme or top-k of a bool or narrow integer tensor over int32, its values
    cast back to the input's type."""
    source = value.args[0]
    again = relax.Call(value.op, [op.astype(source, "int32"), *value.args[1:]], value.attrs)
    dtype = str(source.ty.dtype)
    if value.op.name != "relax.topk":
        return op.astype(again, dtype) if str(value.ty.dtype) == dtype else again
    kind = str(value.attrs.ret_type)  # values and indices, or either alone
    if kind == "both":
        return relax.Tuple([op.astype(relax.TupleGetItem(again, 0), dtype), relax.TupleGetItem(again, 1)])
    return op.astype(again, dtype) if kind == "values" else again


def _as_integer(args: list[relax.Expr]) -> list[relax.Expr]:
    """The boolean operands cast to the other operand's integer type, else to ``int32`` (TVM's
    sort kernels have no narrower integer)."""
    others = [str(a.ty.dtype) for a in args if isinstance(a.ty, relax.TensorType) and not _is_bool(a)]
    target = others[0] if others and ("int" in others[0]) else "int32"
    return [op.astype(a, target) if _is_bool(a) else a for a in args]


def bool_operands(value: relax.Expr, bound: dict) -> relax.Expr | None:
    """The rule: a comparison, arithmetic op or max/min reduction reading a boolean tensor; an
    arg-extreme, sort or top-k (``x.max(dim)``, ``x.min(dim)``) reading a boolean or narrow
    integer one."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return None
    name = value.op.name
    if name not in (*COMPARISONS, *ARITHMETIC, *REDUCTIONS, *SCANS, "relax.topk"):
        return None
    args = list(value.args)
    if name in (*SCANS, "relax.topk"):
        return _ordered_as_int32(value) if _is_narrow(args[0]) else None
    if not any(_is_bool(a) for a in args):
        return None
    if name in REDUCTIONS:
        axis = value.attrs.axis
        reduced = REDUCTIONS[name](_as_integer(args)[0], None if axis is None else list(axis), value.attrs.keepdims)
        return op.astype(reduced, "bool")
    if any(not isinstance(a.ty, relax.TensorType) or "float" in str(a.ty.dtype) for a in args):
        return None  # a float beside a bool: the frontend casts those itself
    if name in COMPARISONS:
        return COMPARISONS[name](*_as_integer(args))
    result = ARITHMETIC[name](*_as_integer(args))
    return op.astype(result, "bool") if _is_bool(value) else result


def BoolsAsIntegers() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """Every boolean comparison, arithmetic op, reduction and sort, and every sort of a narrow
    integer, through ``int32``."""
    return RewriteBindings([bool_operands])
