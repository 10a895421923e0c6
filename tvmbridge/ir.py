"""Relax IR helpers shared by the passes and the stages after them.

The bridge works on functions of one dataflow block (what the frontend makes for a pure module).
Rewrites are rules over bindings: each rule sees a binding's value and the values bound so far and
may return a replacement of the same type (or an existing var to alias); :class:`RewriteBindings`
is the module pass that applies a rule list, :func:`cleanup` the passes that fold what it leaves.
"""
from __future__ import annotations

from typing import Any, Callable

import tvm
import tvm_ffi
from tvm import relax

from .errors import ConversionError

Rule = Callable[[relax.Expr, dict[relax.Var, relax.Expr]], relax.Expr | None]


def only_dataflow_block(func: relax.Function, stage: str) -> relax.DataflowBlock:
    """The function's single dataflow block; anything else is named, not half-handled."""
    body = func.body
    if not isinstance(body, relax.SeqExpr) or len(body.blocks) != 1 or not isinstance(
        body.blocks[0], relax.DataflowBlock
    ):
        raise ConversionError(
            stage, "expected a function with exactly one dataflow block (a pure module without "
            "control flow or side effects)"
        )
    return body.blocks[0]


def rebuild(
    func: relax.Function,
    params: list[relax.Var],
    bindings: list[relax.Binding],
    result: relax.Expr,
    attrs: dict | None = None,
) -> relax.Function:
    """A new function with the given params and dataflow bindings, ``func``'s attributes (updated
    by ``attrs``), normalized."""
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], result)
    new = relax.Function(params, body, ret_ty=result.ty, is_pure=True)
    merged = dict(func.attrs) if func.attrs is not None else {}
    merged.update(attrs or {})
    for k, v in merged.items():
        new = new.with_attr(k, v)
    return relax.transform.Normalize()(tvm.IRModule({"f": new}))["f"]


def _symbolic_shape(expr: relax.Expr) -> bool:
    return isinstance(expr, relax.ShapeExpr) and any(not isinstance(v, tvm.tirx.IntImm) for v in expr.values)


def lift_symbolic_shapes(func: relax.Function) -> tuple[relax.Function, dict[relax.Var, relax.ShapeExpr]]:
    """Every symbolic shape argument of a call (``reshape(x, (n*m, 64))``) as an extra parameter.

    Relax 0.27 has mutators that, since TIR and Relax variables share one class, visit the TIR
    variables inside such a shape as if they were Relax ones: ``Gradient`` fails (``KeyError: key
    is not in Map``) and ``copy_with_new_vars`` leaves them unrenamed while it renames those in
    the types. A parameter passes both unharmed (its type is renamed consistently); the shapes
    are put back, from the parameters' types, by :func:`restore_symbolic_shapes`."""
    block = only_dataflow_block(func, "symbolic shapes")
    lifted: dict[relax.Var, relax.ShapeExpr] = {}
    bindings = []
    for b in block.bindings:
        value = _without_symbolic_shape(b.value)
        if isinstance(value, relax.Call) and any(_symbolic_shape(a) for a in value.args):
            args = [_shape_param(a, lifted) if _symbolic_shape(a) else a for a in value.args]
            value = relax.Call(value.op, args, value.attrs, value.ty_args)
        bindings.append(relax.VarBinding(b.var, value))
    if not lifted:
        return func, lifted
    return rebuild(func, list(func.params) + list(lifted), bindings, func.body.body), lifted


def _same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(str(x) == str(y) for x, y in zip(a, b))


def _without_symbolic_shape(value: relax.Expr) -> relax.Expr:
    """``value`` without its symbolic shape argument where it needs none: a broadcast or reshape
    to the shape its input already has is the input (a reshape to ``-1`` is no way out: in the
    copy Gradient makes, the input's shape may be known only through a lifted one).
    A lifted shape costs the shapes downstream (a copy infers ``R.Tensor(shape_arg)`` for the
    result, and broadcasting ops then know only its rank), so the fewer, the better."""
    if not (is_op(value, "relax.broadcast_to") or is_op(value, "relax.reshape")) or not _symbolic_shape(value.args[1]):
        return value
    x, shape = value.args
    known = getattr(x.ty, "shape", None)
    target = list(shape.values)
    if isinstance(known, relax.ShapeExpr) and _same_shape(list(known.values), target):
        return x
    return value


def _shape_param(shape: relax.ShapeExpr, lifted: dict[relax.Var, relax.ShapeExpr]) -> relax.Var:
    for var, known in lifted.items():
        if tvm_ffi.structural_equal(known, shape):
            return var
    var = relax.Var(f"shape_arg{len(lifted)}", shape.ty)
    lifted[var] = shape
    return var


def restore_symbolic_shapes(func: relax.Function, lifted: dict[relax.Var, relax.ShapeExpr]) -> relax.Function:
    """``func`` with the lifted shape parameters (found by name: a pass may rebuild them) replaced
    by the shapes their types hold, and removed."""
    if not lifted:
        return func
    names_ = {var.name for var in lifted}
    params = [p for p in func.params if p.name in names_]
    if len(params) != len(lifted):
        raise ConversionError("symbolic shapes", "the lifted shape parameters are missing from the function")

    def shape_of(arg: relax.Expr) -> relax.Expr | None:
        return next((relax.ShapeExpr(list(p.ty.values)) for p in params if arg.same_as(p)), None)

    bindings = []
    for b in only_dataflow_block(func, "symbolic shapes").bindings:
        value = b.value
        if isinstance(value, relax.Call) and any(shape_of(a) is not None for a in value.args):
            value = relax.Call(value.op, [shape_of(a) or a for a in value.args], value.attrs, value.ty_args)
        elif any(shape_of(v) is not None for v in relax.analysis.free_vars(value)):
            raise ConversionError("symbolic shapes", f"a symbolic shape is used outside a call argument: {b.var.name}")
        bindings.append(relax.VarBinding(b.var, value))
    kept = [p for p in func.params if not any(p.same_as(q) for q in params)]
    return rebuild(func, kept, bindings, func.body.body)


def copy_with_fresh_vars(func: relax.Function) -> relax.Function:
    """``relax.utils.copy_with_new_vars`` that also renames the TIR variables inside shape
    arguments (see :func:`lift_symbolic_shapes`)."""
    lifted_func, lifted = lift_symbolic_shapes(func)
    return restore_symbolic_shapes(relax.utils.copy_with_new_vars(lifted_func), lifted)


def binding_map(block: relax.DataflowBlock) -> dict[relax.Var, relax.Expr]:
    return {b.var: b.value for b in block.bindings}


def is_op(expr: relax.Expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    """The shape of a tensor-typed expression when every dimension is a known integer."""
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        try:
            return tuple(int(s) for s in ty.shape)
        except (TypeError, ValueError):
            return None
    return None


def evaluate_dim(dim: Any, sizes: dict[str, int]) -> int:
    """A Relax dimension (an int or a TIR expression over shape vars) at the given sizes."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, tvm.tirx.IntImm):
        return int(dim.value)
    if tvm.ir.is_prim_var(dim):
        if dim.name not in sizes:
            raise KeyError(f"no size for the shape variable {dim.name}")
        return sizes[dim.name]
    ops = {tvm.tirx.Add: lambda a, b: a + b, tvm.tirx.Sub: lambda a, b: a - b, tvm.tirx.Mul: lambda a, b: a * b,
           tvm.tirx.FloorDiv: lambda a, b: a // b, tvm.tirx.FloorMod: lambda a, b: a % b,
           tvm.tirx.Max: max, tvm.tirx.Min: min}
    for kind, fn in ops.items():
        if isinstance(dim, kind):
            return fn(evaluate_dim(dim.a, sizes), evaluate_dim(dim.b, sizes))
    raise ValueError(f"cannot evaluate the dimension {dim}")


def shape_at(expr: relax.Expr, sizes: dict[str, int]) -> tuple[int, ...] | None:
    """The shape of a tensor-typed expression with its symbolic dims at ``sizes``."""
    ty = getattr(expr, "ty", None)
    if not (isinstance(ty, relax.TensorType) and ty.shape is not None):
        return None
    try:
        return tuple(evaluate_dim(s, sizes) for s in ty.shape)
    except (KeyError, ValueError, TypeError):
        return None


def same_tensor_type(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = static_shape(a), static_shape(b)
    return sa is not None and sa == sb and str(a.ty.dtype) == str(b.ty.dtype)


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
        value, n = _rewrite_value(b.value, bound, rules)
        count += n
        bound[b.var] = value
        out.append(b if value.same_as(b.value) else relax.VarBinding(b.var, value))
    if not count:
        return func, 0
    return rebuild(func, list(func.params), out, body.body), count


def _rewrite_value(value: relax.Expr, bound: dict, rules: list[Rule]) -> tuple[relax.Expr, int]:
    count = 0
    changed = True
    while changed:
        changed = False
        for rule in rules:
            new = rule(value, bound)
            if new is not None and not new.same_as(value):
                value, changed, count = new, True, count + 1
                break
    return value, count


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.RewriteBindings")
class RewriteBindings:
    """Apply binding rules to every Relax function of a module (a new module; the input is not
    changed)."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        out = mod.clone()
        for gv, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                new, n = rewrite_function(func, self.rules)
                if n:
                    out[gv] = new
        return out


def cleanup() -> list[tvm.transform.Pass]:
    """Fold the aliases a rewrite leaves, then common subexpressions and dead code."""
    return [
        relax.transform.CanonicalizeBindings(),
        relax.transform.EliminateCommonSubexpr(),
        relax.transform.CanonicalizeBindings(),
        relax.transform.DeadCodeElimination(),
    ]


def rewrite_and_clean(rules: list[Rule]) -> tvm.transform.Pass:
    """Normalize, apply ``rules``, clean up: one ``Sequential``."""
    return tvm.transform.Sequential([relax.transform.Normalize(), RewriteBindings(rules), *cleanup()])
