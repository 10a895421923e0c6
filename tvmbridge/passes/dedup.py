"""Dedup: remove duplicated layout work and duplicated values.

The frontend emits a reshape/permute around every linear and attention op, and the reverse sweep adds
their transposes; chains of them are common. This pass folds permute-of-permute (dropping identity
permutations), then reshape-of-reshape and reshape-to-the-same-shape (TVM's
``RemoveRedundantReshape``: on the bridge's modules it does what the bridge's own rule did, and
also folds symbolic shapes, which that rule left), then TVM's CSE (duplicate shape constants and
duplicate calls) and dead-code elimination.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..ir import RewriteBindings, cleanup, is_op, static_shape


def _lookup(expr: relax.Expr, bound: dict) -> relax.Expr:
    return bound.get(expr, expr) if isinstance(expr, relax.Var) else expr


def _axes(call: relax.Call, ndim: int) -> list[int]:
    axes = call.attrs.axes
    return [int(a) for a in axes] if axes is not None else list(reversed(range(ndim)))


def fold_permutes(value: relax.Expr, bound: dict) -> relax.Expr | None:
    if not is_op(value, "relax.permute_dims"):
        return None
    x = value.args[0]
    shape = static_shape(x)
    if shape is None:
        return None
    outer = _axes(value, len(shape))
    if outer == list(range(len(shape))):
        return x
    inner_call = _lookup(x, bound)
    if is_op(inner_call, "relax.permute_dims"):
        base = inner_call.args[0]
        bshape = static_shape(base)
        if bshape is None:
            return None
        inner = _axes(inner_call, len(bshape))
        composed = [inner[a] for a in outer]
        if composed == list(range(len(bshape))):
            return base
        return relax.op.permute_dims(base, composed)
    return None


def Dedup() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """Fold permute and reshape chains, then CSE and dead code."""
    return tvm.transform.Sequential(
        [
            relax.transform.Normalize(),
            RewriteBindings([fold_permutes]),
            relax.transform.RemoveRedundantReshape(),
            *cleanup(),
        ]
    )
