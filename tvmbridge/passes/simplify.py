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

from ..ir import RewriteBindings, Rule, cleanup, is_op, rewrite_and_clean, same_tensor_type, static_shape
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


def one_hot_sums(value: relax.Expr, bound: dict) -> relax.Expr | None:
    """``sum(where(position == index, v, 0), axis, keepdims=True)`` over the positions
    ``0..n-1`` along ``axis``, ``index`` and ``v`` one element along it: ``v`` where the index is
    one of the positions, else 0. A class-index loss's gradient is such a one-hot
    (``gradients.gather_elements_grad``), and log-softmax's gradient sums it over the classes:
    without the rule the one-hot is written out whole for that sum."""
    if not is_op(value, "relax.sum") or not value.attrs.keepdims or value.attrs.axis is None:
        return None
    axes = [int(a) for a in value.attrs.axis]
    selected = _bound_call(value.args[0], bound, "relax.where")
    shape = static_shape(value)
    if len(axes) != 1 or selected is None or shape is None or constant_value(selected.args[2], bound) != 0.0:
        return None
    condition = _bound_call(selected.args[0], bound, "relax.equal")
    values, whole = static_shape(selected.args[1]), static_shape(selected)
    if condition is None or values is None or whole is None:
        return None
    axis = axes[0] % len(shape)
    for positions, index in (condition.args, reversed(condition.args)):
        n, index_shape = _positions(positions, bound, axis, len(shape)), static_shape(index)
        if n is None or index_shape is None or n != whole[axis]:
            continue
        if np.broadcast_shapes(index_shape, values) != shape:
            return None
        op, dtype = relax.op, str(index.ty.dtype)
        inside = op.logical_and(op.greater_equal(index, relax.const(0, dtype)), op.less(index, relax.const(n, dtype)))
        return op.where(inside, selected.args[1], selected.args[2])
    return None


def _bound_call(expr: relax.Expr, bound: dict, name: str) -> relax.Call | None:
    """The call of op ``name`` that ``expr`` (a variable) is bound to, if it is one."""
    value = bound.get(expr) if isinstance(expr, relax.Var) else None
    return value if is_op(value, name) else None


def _positions(expr: relax.Expr, bound: dict, axis: int, ndim: int) -> int | None:
    """``n`` where ``expr`` is ``arange(0, n)`` laid along ``axis`` of ``ndim`` axes."""
    while isinstance(expr, relax.Var) and expr in bound:
        expr = bound[expr]
    shape = static_shape(expr)
    if is_op(expr, "relax.reshape"):
        inner = expr.args[0]
        expr = bound.get(inner, inner) if isinstance(inner, relax.Var) else inner
    if not is_op(expr, "relax.arange") or shape is None or len(shape) != ndim:
        return None
    start, end, step = (_int(a) for a in expr.args[:3])
    if (start, step) != (0, 1) or end is None:
        return None
    return end if shape == tuple(end if i == axis else 1 for i in range(ndim)) else None


def _int(arg: relax.Expr) -> int | None:
    return int(arg) if isinstance(arg, tvm.tirx.IntImm) else None


SIMPLIFY_RULES: list[Rule] = [identities, like_to_shape, one_hot_sums]


def Simplify() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """Neutral elements, ``*_like`` to shapes, same-shape broadcasts, sums of a one-hot; then CSE
    and dead code."""
    return rewrite_and_clean(SIMPLIFY_RULES)


def DedupAndSimplify() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """``Dedup``'s folds, then ``Simplify``'s rules, under one clean-up: each alone ends in the
    same clean-up passes, which are most of their time on a large module."""
    return tvm.transform.Sequential(
        [relax.transform.Normalize(), *dedup_folds(), RewriteBindings(SIMPLIFY_RULES), *cleanup()]
    )
