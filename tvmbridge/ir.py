"""Relax IR helpers shared by the passes and the stages after them.

The bridge works on functions of one dataflow block (what the frontend makes for a pure module).
Rewrites are rules over bindings: each rule sees a binding's value and the values bound so far and
may return a replacement of the same type (or an existing var to alias); :class:`RewriteBindings`
is the module pass that applies a rule list, :func:`cleanup` the passes that fold what it leaves.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tvm
from tvm import relax

from .errors import ConversionError
from .sizes import evaluate_dim

Rule = Callable[[relax.Expr, dict[relax.Var, relax.Expr]], relax.Expr | None]


def end_open_blocks(bb: relax.BlockBuilder) -> None:
    """End the binding blocks an exception left open in ``bb``. An exception raised inside
    ``with bb.function(...)`` leaves the C++ builder with a block open (TVM's Python scopes unwind
    their own stacks only and, leaving ``bb.dataflow()``, begin a new block), and TVM logs
    "BlockBuilder destroyed with remaining blocks!" to stderr whenever the builder is freed, long
    after the error was handled. The builder is not to be used again."""
    for _ in range(16):  # one block in practice; "no block is being built" ends the loop
        try:
            bb._end_block()  # TVM has no public way to end a block
        except Exception:  # "no block is being built"
            return


@contextlib.contextmanager
def blocks_closed_on_error(bb: relax.BlockBuilder) -> Iterator[None]:
    """Around ``with bb.function(...)``: on an exception, :func:`end_open_blocks` before it goes on."""
    try:
        yield
    except BaseException:
        end_open_blocks(bb)
        raise


def only_dataflow_block(func: relax.Function, stage: str) -> relax.DataflowBlock:
    """The function's single dataflow block; anything else is named, not half-handled."""
    body = func.body
    if (
        not isinstance(body, relax.SeqExpr)
        or len(body.blocks) != 1
        or not isinstance(body.blocks[0], relax.DataflowBlock)
    ):
        raise ConversionError(
            stage,
            "expected a function with exactly one dataflow block (a pure module without control flow or side effects)",
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


def copy_with_fresh_vars(func: relax.Function) -> relax.Function:
    """``func`` with new Relax variables and new TIR size variables (a module may define each
    once; the forward, backward and inference functions come from one adjoint), every type kept
    as it is. ``relax.utils.copy_with_new_vars`` re-infers the types of the copied bindings
    (weaker ones: a tensor sized by a shape variable loses its dimensions) and, in TVM 0.27,
    leaves the size variables inside shape arguments unrenamed."""
    renamed: dict[relax.Var, relax.Var] = {}

    def fresh(var: relax.Var) -> relax.Var:
        kind = relax.DataflowVar if isinstance(var, relax.DataflowVar) else relax.Var
        renamed[var] = kind(var.name, var.ty)
        return renamed[var]

    params = [fresh(p) for p in func.params]
    bindings = []
    for b in only_dataflow_block(func, "copy").bindings:
        value = with_vars(b.value, renamed)
        bindings.append(relax.VarBinding(fresh(b.var), value))
    copy = rebuild(func, params, bindings, with_vars(func.body.body, renamed))
    sizes = {v: tvm.tirx.Var(v.name, "int64") for v in _size_vars(copy.params)}
    return copy.bind_symbolic_vars(sizes) if sizes else copy


def with_vars(expr: relax.Expr, renamed: dict[relax.Var, relax.Var]) -> relax.Expr:
    """``expr`` (a binding's value, or what a legalization returns) reading the renamed
    variables; only where :func:`rewrites_whole` holds are none of the old ones left."""
    if isinstance(expr, relax.Var):
        return renamed.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([with_vars(f, renamed) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(with_vars(expr.tuple_value, renamed), expr.index)
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [with_vars(a, renamed) for a in expr.args], expr.attrs, expr.ty_args)
    return expr  # constants, shapes, sizes


def rewrites_whole(expr: Any) -> bool:
    """:func:`with_vars` renames every variable ``expr`` reads: they sit in calls, tuples and
    projections only, and every other leaf (a constant, a shape, a kernel's name) reads none."""
    if isinstance(expr, relax.Var):
        return True
    if isinstance(expr, relax.Tuple):
        return all(rewrites_whole(f) for f in expr.fields)
    if isinstance(expr, relax.TupleGetItem):
        return rewrites_whole(expr.tuple_value)
    if isinstance(expr, relax.Call):
        return rewrites_whole(expr.op) and all(rewrites_whole(a) for a in expr.args)
    return not isinstance(expr, relax.Expr) or not relax.analysis.free_vars(expr)


def _size_vars(params: list[relax.Var]) -> list:
    """The TIR size variables the parameters' types define, in order of appearance."""
    found: dict[str, Any] = {}
    for p in params:
        shape = getattr(p.ty, "shape", None)
        values = list(shape.values) if isinstance(shape, relax.ShapeExpr) else []
        if isinstance(p.ty, relax.ShapeType) and p.ty.values is not None:
            values = list(p.ty.values)
        for v in values:
            if tvm.ir.is_prim_var(v):
                found.setdefault(v.name, v)
    return list(found.values())


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


def first_schedule(rules: list, func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> Any:
    """The schedule the first of the dlight ``rules`` that applies gives ``func`` (what
    ``ApplyDefaultSchedule`` would give it), or None when none does."""
    with target:
        for rule in rules:
            space = rule.apply(func, target, False)
            if space is not None:
                return space[0] if isinstance(space, list) else space
    return None


def per_function(transform: tvm.transform.Pass, mod: tvm.IRModule) -> tvm.IRModule:
    """``transform``, a pass local to each Relax function, run on each function of ``mod`` in its
    own module, the functions in threads: TVM's passes run outside the GIL, so a training module's
    forward, backward and inference functions take about the time of the largest. In the caller's
    pass context (a copy in each thread, TVM's current context being per thread); under pass
    instruments, which expect passes in order, on the whole module in this thread."""
    caller = tvm.transform.PassContext.current()
    functions = list(mod.functions_items())
    relax_only = all(isinstance(f, relax.Function) for _, f in functions)
    if len(functions) <= 1 or not relax_only or list(caller.instruments) or _cores() <= 1:
        return transform(mod)

    def run(item: tuple[tvm.ir.GlobalVar, relax.Function]) -> tvm.IRModule:
        context = tvm.transform.PassContext(
            opt_level=caller.opt_level,
            required_pass=list(caller.required_pass),
            disabled_pass=list(caller.disabled_pass),
            config=dict(caller.config),
        )
        with context:
            return transform(tvm.IRModule({item[0]: item[1]}, attrs=mod.attrs))

    with ThreadPoolExecutor(min(len(functions), _cores()), thread_name_prefix="tvmbridge-pass") as pool:
        done = list(pool.map(run, functions))
    out = mod.clone()
    for part in done:
        for gv, func in part.functions_items():
            out[gv] = func
    return out


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
