"""Comparisons, arithmetic and reductions over ``bool`` tensors, through ``int32``.

PyTorch compares and adds boolean tensors (``mask > 0``, ``mask == True``, ``mask + mask``,
``mask.max()``: LongT5's local attention mask) as 0/1 values. Relax types them and legalizes
them, but TVM's LLVM code generation has no comparison or arithmetic of its ``bool`` type (it
asserts a float type, or fails LLVM's verifier, or has no ``min_value`` for a reduction's
identity): the whole compile failed. Here every such call reads its boolean operands cast to
``int32`` (or to the other operand's integer type) and, where PyTorch's result is boolean
(``mask + mask``, ``mask.max()``), casts the result back: the same values PyTorch computes.
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


def _is_bool(expr: relax.Expr) -> bool:
    ty = getattr(expr, "ty", None)
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == "bool"


def _as_integer(args: list[relax.Expr]) -> list[relax.Expr]:
    """The boolean operands cast to the other operand's integer type, else to ``int32`` (TVM's
    sort kernels have no narrower integer)."""
    others = [str(a.ty.dtype) for a in args if isinstance(a.ty, relax.TensorType) and not _is_bool(a)]
    target = others[0] if others and ("int" in others[0]) else "int32"
    return [op.astype(a, target) if _is_bool(a) else a for a in args]


def bool_operands(value: relax.Expr, bound: dict) -> relax.Expr | None:
    """The rule: a comparison, arithmetic op, max/min reduction, arg-extreme, sort or top-k
    (``x.max(dim)``, ``x.min(dim)``) reading a boolean tensor."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return None
    name = value.op.name
    if name not in (*COMPARISONS, *ARITHMETIC, *REDUCTIONS, *SCANS, "relax.topk"):
        return None
    args = list(value.args)
    if not any(_is_bool(a) for a in args):
        return None
    if name in SCANS:
        again = relax.Call(value.op, _as_integer(args), value.attrs)
        return op.astype(again, "bool") if _is_bool(value) else again
    if name == "relax.topk":  # values (bool again) and indices, or either alone
        again = relax.Call(value.op, _as_integer(args), value.attrs)
        kind = str(value.attrs.ret_type)
        if kind == "both":
            return relax.Tuple([op.astype(relax.TupleGetItem(again, 0), "bool"), relax.TupleGetItem(again, 1)])
        return op.astype(again, "bool") if kind == "values" else again
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
    """Every boolean comparison, arithmetic op, reduction and sort through ``int32``."""
    return RewriteBindings([bool_operands])
