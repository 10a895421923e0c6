"""Dedup: remove duplicated layout work and duplicated values.

The frontend emits a reshape/permute around every linear and attention op, and the reverse sweep adds
their transposes; chains of them are common. This pass folds permute-of-permute (dropping identity
permutations; TVM's pattern rewriter, ``relax.dpl``), then reshape-of-reshape and reshape-to-the-same-shape (TVM's
``RemoveRedundantReshape``: on the bridge's modules it does what the bridge's own rule did, and
also folds symbolic shapes, which that rule left), then TVM's CSE (duplicate shape constants and
duplicate calls) and dead-code elimination.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import dpl

from ..ir import cleanup, static_shape


def _axes(call: relax.Call, ndim: int) -> list[int]:
    axes = call.attrs.axes
    return [int(a) for a in axes] if axes is not None else list(reversed(range(ndim)))


_BASE = dpl.wildcard()
_INNER = dpl.is_op("relax.permute_dims")(_BASE)
PERMUTE_OF_PERMUTE = dpl.is_op("relax.permute_dims")(_INNER)
_X = dpl.wildcard()
PERMUTE = dpl.is_op("relax.permute_dims")(_X)


def drop_identity(call: relax.Expr, matched: dict[dpl.DFPattern, relax.Expr]) -> relax.Expr:
    """A permutation that keeps every axis in place is its input."""
    x = matched[_X]
    shape = static_shape(x)
    return x if shape is not None and _axes(call, len(shape)) == list(range(len(shape))) else call


def compose(call: relax.Expr, matched: dict[dpl.DFPattern, relax.Expr]) -> relax.Expr:
    """A permute of a permute is one permute of the first one's input (or that input itself)."""
    base, inner = matched[_BASE], matched[_INNER]
    shape = static_shape(base)
    if shape is None:
        return call
    composed = [_axes(inner, len(shape))[a] for a in _axes(call, len(shape))]
    return base if composed == list(range(len(shape))) else relax.op.permute_dims(base, composed)


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.FoldPermutes")
def fold_permutes(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Identity permutations dropped and permute chains composed, with TVM's pattern rewriter
    (``relax.dpl``; ``rewrite_call`` repeats until nothing matches)."""
    out = mod.clone()
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            out[gv] = dpl.rewrite_call(PERMUTE_OF_PERMUTE, compose, dpl.rewrite_call(PERMUTE, drop_identity, func))
    return out


def dedup_folds() -> list[tvm.transform.Pass]:
    """Permute chains, then reshape chains, folded."""
    return [fold_permutes, relax.transform.RemoveRedundantReshape()]


def Dedup() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """Fold permute and reshape chains, then CSE and dead code."""
    return tvm.transform.Sequential([relax.transform.Normalize(), *dedup_folds(), *cleanup()])
