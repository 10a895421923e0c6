"""Algebraic simplification of gradient code.

The reverse sweep seeds the target with ``ones(())``, broadcasts it, multiplies by the output grad,
adds zero adjoints and uses ``*_like`` ops. Those are cheap but they keep values alive (``zeros_like(x)``
reads ``x``, so ``x`` would be captured for nothing) and cost kernels. Rules:
``x*1 -> x``, ``x+0 -> x``, ``x-0 -> x``, ``zeros_like/ones_like(x) -> zeros/ones(shape)``,
``broadcast_to``/``collapse_sum_to``/``reshape`` to the same shape ``-> x``; then CSE and DCE.
A rule fires only when the result keeps the exact shape and dtype, so nothing is silently broadcast.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import RewriteBindings, cleanup, is_op, rewrite_and_clean, same_tensor_type, static_shape
from .dedup import dedup_folds


def constant_value(expr: relax.Expr, bound: dict, depth: int = 0) -> float | None:
    """The single value every element of ``expr`` has, if it is known at compile time."""
    if depth > 8:
        return None
    if isinstance(expr, relax.Var):
        v = bound.get(expr)
        return None if v is None else constant_value(v, bound, depth + 1)
    if isinstance(expr, tvm.ir.expr.Constant):
        arr = expr.value.numpy()
        flat = arr.reshape(-1)
        if flat.size and np.all(flat == flat[0]):
            return float(flat[0])
        return None
    if is_op(expr, "relax.ones") or is_op(expr, "relax.ones_like"):
        return 1.0
    if is_op(expr, "relax.zeros") or is_op(expr, "relax.zeros_like"):
        return 0.0
    if is_op(expr, "relax.full") or is_op(expr, "relax.full_like"):
        return constant_value(expr.args[1], bound, depth + 1)
    if is_op(expr, "relax.broadcast_to") or is_op(expr, "relax.reshape"):
        return constant_value(expr.args[0], bound, depth + 1)
    return None


def identities(value: relax.Expr, bound: dict) -> relax.Expr | None:
    if getattr(value, "ty", None) is None:
        return None
    for name, neutral in (("relax.multiply", 1.0), ("relax.add", 0.0)):
        if is_op(value, name):
            a, b = value.args
            if constant_value(b, bound) == neutral and same_tensor_type(value, a):
                return a
            if constant_value(a, bound) == neutral and same_tensor_type(value, b):
                return b
    if is_op(value, "relax.subtract"):
        a, b = value.args
        if constant_value(b, bound) == 0.0 and same_tensor_type(value, a):
            return a
    for name in ("relax.broadcast_to", "relax.collapse_sum_to", "relax.reshape"):
        if is_op(value, name) and same_tensor_type(value, value.args[0]):
            return value.args[0]
    return None


def like_to_shape(value: relax.Expr, bound: dict) -> relax.Expr | None:
    """``zeros_like``/``ones_like`` of a static shape: the op first (most bindings are neither),
    then the shape."""
    if is_op(value, "relax.zeros_like"):
        make = relax.op.zeros
    elif is_op(value, "relax.ones_like"):
        make = relax.op.ones
    else:
        return None
    shape = static_shape(value) if getattr(value, "ty", None) is not None else None
    return None if shape is None else make(shape, str(value.ty.dtype))


def Simplify() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """Neutral elements, ``*_like`` to shapes, same-shape broadcasts; then CSE and dead code."""
    return rewrite_and_clean([identities, like_to_shape])


def DedupAndSimplify() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """``Dedup``'s folds, then ``Simplify``'s rules, under one clean-up: each alone ends in the
    same clean-up passes, which are most of their time on a large module."""
    return tvm.transform.Sequential(
        [relax.transform.Normalize(), *dedup_folds(), RewriteBindings([identities, like_to_shape]), *cleanup()]
    )
