"""Small Relax expression helpers the bridge's gradient formulas share (``gradients_nn``,
``gradients_conv``): one place for how a dtype, a constant, a static shape and a broadcast
gradient's fit are read, so the formula modules agree on them."""

from __future__ import annotations

from typing import Any

import tvm
from tvm import relax
from tvm.relax import BlockBuilder, Expr

op = relax.op


def dtype_of(expr: Expr) -> str:
    return str(expr.ty.dtype)


def const(value: float, like: Expr) -> Expr:
    return relax.const(value, dtype_of(like))


def scalar(expr: Expr) -> float:
    """The number a ``PrimValue``/``FloatImm``/``IntImm`` argument holds."""
    value = getattr(expr, "value", expr)
    return float(getattr(value, "value", value))


def static_dims(expr: Expr, what: str) -> list[int]:
    """The static shape of a tensor, or a refusal naming the op that needs one."""
    try:
        return [int(d) for d in expr.ty.shape]
    except (TypeError, ValueError, AttributeError):
        raise NotImplementedError(f"the gradient of {what} needs static shapes; got {expr.ty}") from None


def sizes_of(expr: Expr, what: str) -> list[Any]:
    """A tensor's sizes, each an int where static, else its symbolic expression; a refusal naming
    the op where not even the rank is known."""
    shape = getattr(expr.ty, "shape", None)
    if shape is None:
        raise NotImplementedError(f"the gradient of {what} needs a known shape; got {expr.ty}")
    return [int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in shape]


def batch_and_static_dims(expr: Expr, what: str) -> tuple[Any, list[int]]:
    """A tensor's leading (batch) size, an int or symbolic (a variant serving every batch size),
    and its other sizes, which must be static (a refusal naming the op otherwise)."""
    shape = list(expr.ty.shape)
    try:
        rest = [int(d) for d in shape[1:]]
    except (TypeError, ValueError):
        raise NotImplementedError(f"the gradient of {what} needs static sizes after the batch; got {expr.ty}") from None
    lead = shape[0]
    return (int(lead) if isinstance(lead, tvm.tirx.IntImm) else lead), rest


def fit_shape(grad: Expr, like: Expr) -> Expr:
    """``grad`` summed down to ``like``'s shape where a broadcast widened it (to ``like`` itself
    where either shape is known only by rank)."""
    gs, ls = _dims(grad), _dims(like)
    if gs is None or ls is None:
        return op.collapse_sum_like(grad, like)
    if len(gs) == len(ls) and all(str(a) == str(b) for a, b in zip(gs, ls)):
        return grad
    return op.collapse_sum_to(grad, like.ty.shape)


def _dims(expr: Expr) -> list | None:
    shape = getattr(expr.ty, "shape", None)
    return list(shape) if isinstance(shape, (relax.ShapeExpr, list, tuple)) else None


def emit(ctx: BlockBuilder, expr: Expr) -> Expr:
    """Normalized so that its type (shape) can be read by the next step."""
    return ctx.normalize(expr)
