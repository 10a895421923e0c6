"""Dedup: remove duplicated layout work and duplicated values.

The frontend emits a reshape/permute around every linear and attention op, and the reverse sweep adds
their transposes; chains of them are common. This pass folds permute-of-permute (dropping identity
permutations), reshape-of-reshape and reshape-to-the-same-shape (symbolic shapes too), then TVM's
CSE (duplicate shape constants and duplicate calls) and dead-code elimination.

The folds are binding rules (``ir.RewriteBindings``): one walk over the bindings, each chain
folded as its last link is reached. TVM's pattern rewriter (``relax.dpl.rewrite_call``, which
``RemoveRedundantReshape`` is built on) does the same folds but rewrites the whole function again
until nothing matches, which on a whole model's adjoint took seconds where the walk takes a
fraction of one; the rules keep its semantics (a reshape target with a ``0`` is moved onto another
input only where it asks for the same shape there).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from ..ir import RewriteBindings, cleanup, is_op


def _axes(call: relax.Call, ndim: int) -> list[int]:
    axes = call.attrs.axes
    return [int(a) for a in axes] if axes is not None else list(reversed(range(ndim)))


def fold_permute(value: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> relax.Expr | None:
    """An identity permutation is its input; a permute of a permute is one permute of the first
    one's input (or that input itself)."""
    if not is_op(value, "relax.permute_dims"):
        return None
    x = value.args[0]
    ndim = getattr(x.ty, "ndim", -1)
    if ndim < 0:
        return None
    axes = _axes(value, ndim)
    if axes == list(range(ndim)):
        return x
    inner = bound.get(x)
    if inner is None or not is_op(inner, "relax.permute_dims"):
        return None
    composed = [_axes(inner, ndim)[a] for a in axes]
    base = inner.args[0]
    return base if composed == list(range(ndim)) else relax.op.permute_dims(base, composed)


def _reshape_asks_the_same(arg: relax.Expr, target: relax.Expr) -> bool:
    """Whether ``reshape(arg, target)`` still asks for ``target``: a ``0`` in a target copies the
    input's dimension, so a target moves onto another input only where it resolves the same."""
    try:
        moved = relax.op.reshape(arg, target)
    except Exception:  # TVM cannot resolve a 0 or -1 without the input's shape  # noqa: BLE001
        return False
    return bool(tvm_ffi.structural_equal(moved.args[1], target))


def fold_reshape(value: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> relax.Expr | None:
    """A reshape of a reshape is one reshape of the first one's input; a reshape to its input's
    own shape (static or symbolic) is that input."""
    if not is_op(value, "relax.reshape"):
        return None
    x, target = value.args
    inner = bound.get(x)
    if inner is not None and is_op(inner, "relax.reshape") and _reshape_asks_the_same(inner.args[0], target):
        return relax.op.reshape(inner.args[0], target)
    shape = getattr(x.ty, "shape", None)
    if shape is not None and tvm_ffi.structural_equal(shape, target):
        return x
    return None


def fold_layout_chains() -> tvm.transform.Pass:
    """Permute and reshape chains folded, in one walk over each function's bindings."""
    return tvm.transform.module_pass(
        RewriteBindings([fold_permute, fold_reshape]).transform_module,
        opt_level=0,
        name="tvmbridge.FoldLayoutChains",
    )


def dedup_folds() -> list[tvm.transform.Pass]:
    """Permute chains and reshape chains, folded."""
    return [fold_layout_chains()]


def Dedup() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """Fold permute and reshape chains, then CSE and dead code."""
    return tvm.transform.Sequential([relax.transform.Normalize(), *dedup_folds(), *cleanup()])
