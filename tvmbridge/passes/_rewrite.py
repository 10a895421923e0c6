"""Binding-level rewriting for one dataflow block: each rule sees a binding's value and the values
bound so far, and may return a replacement of the same type (or an existing var to alias)."""
from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax

from ._util import rebuild

Rule = Callable[[relax.Expr, dict[relax.Var, relax.Expr]], relax.Expr | None]


def rewrite_function(func: relax.Function, rules: list[Rule]) -> tuple[relax.Function, int]:
    """Apply ``rules`` to every binding until none fires on it; returns the function and the
    number of rewrites."""
    body = func.body
    if not isinstance(body, relax.SeqExpr) or len(body.blocks) != 1:
        return func, 0
    bound: dict[relax.Var, relax.Expr] = {}
    out: list[relax.Binding] = []
    count = 0
    for b in body.blocks[0].bindings:
        value = b.value
        changed = True
        while changed:
            changed = False
            for rule in rules:
                new = rule(value, bound)
                if new is not None and not new.same_as(value):
                    value, changed, count = new, True, count + 1
                    break
        bound[b.var] = value
        out.append(b if value.same_as(b.value) else relax.VarBinding(b.var, value))
    if not count:
        return func, 0
    return rebuild(func, list(func.params), out, body.body), count


def rewrite_module(mod: tvm.IRModule, rules: list[Rule]) -> tvm.IRModule:
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            new, n = rewrite_function(func, rules)
            if n:
                mod[gv] = new
    return mod


def is_op(expr: relax.Expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        try:
            return tuple(int(s) for s in ty.shape)
        except (TypeError, ValueError):
            return None
    return None


def same_tensor_type(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = static_shape(a), static_shape(b)
    return sa is not None and sa == sb and str(a.ty.dtype) == str(b.ty.dtype)


def rewrite_and_clean(mod: tvm.IRModule, rules: list[Rule]) -> tvm.IRModule:
    """Apply ``rules``, then fold the aliases they leave, CSE and dead-code elimination."""
    mod = relax.transform.Normalize()(mod)
    mod = rewrite_module(mod, rules)
    mod = relax.transform.CanonicalizeBindings()(mod)
    mod = relax.transform.EliminateCommonSubexpr()(mod)
    mod = relax.transform.CanonicalizeBindings()(mod)
    return relax.transform.DeadCodeElimination()(mod)
