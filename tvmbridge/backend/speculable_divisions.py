"""Divisions by a run-time size that LLVM may evaluate ahead of the branch that holds them.

A kernel over symbolic sizes (a symbolic variant's, or one shared across shapes) indexes with
``i // n`` and ``i % n`` where ``n`` is a tensor's size known only at run time. Where such an index
sits in one branch of a select whose branches read memory (``where(x > 0, g[b, c, h * w])``,
ReLU's gradient of a flattened operand), TVM's ``RewriteUnsafeSelect`` makes the select a branch,
and LLVM may not compute a division by an unknown divisor before the branch is taken (it traps
at zero). LLVM 22's loop vectorizer then computes that division once per vector of the inner
loop, but only when the vector's *first* lane takes the branch: a vector whose first lane does
not and another lane does reads at an undefined address (timm's resnet10t segfaulted in its
backward, reading a pointer's worth of float values as an address; a luckier address reads wrong
numbers). The division is only ever by a size, which is positive wherever the loop runs at all.

:func:`with_speculable_divisions` computes every division by a size (an expression of tensor
sizes and non-negative constants) that a loop does not change before that loop, by ``max(n, 1)``:
the same quotient wherever the loop runs (``n >= 1`` there, else the division would trap), no trap
where it does not, and no division left in the loop for the vectorizer to predicate (one per row
instead of one per element, too). Dividing by ``max(n, 1)`` in place is not enough: LLVM folds the
``max`` away under the loop's own ``n > 0`` guard and sinks the division back into the branch. The
pass runs after TVM's TIR pipeline, where no simplifier runs again to undo it; :data:`PIPELINE`
names TVM's pipeline with it (``tvm.tirx.build(..., pipeline=PIPELINE)``).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

PIPELINE = "tvmbridge.speculable_divisions"
_DIVISIONS = (tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod)
_CLOSED = (tirx.Add, tirx.Mul, tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod, tirx.Min, tirx.Max)


def size_vars(mod: tvm.IRModule) -> set[tirx.Var]:
    """Every variable in the shape of a kernel's tensor parameter (a size: never negative). TVM's
    lowering binds these same variables from each tensor's shape, so they can be known after it."""
    found: set[tirx.Var] = set()
    for func in mod.functions.values():
        if isinstance(func, tirx.PrimFunc):
            for param in func.params:
                for dim in getattr(param, "shape", None) or ():
                    found.update(tirx.analysis.undefined_vars(dim))
    return found


def _bindings(func: tirx.PrimFunc) -> dict[tirx.Var, tirx.PrimExpr]:
    """Each variable a ``Bind`` statement or ``Let`` expression gives a value (common
    subexpressions: ``cse_v1 = n0 * n2``)."""
    bound: dict[tirx.Var, tirx.PrimExpr] = {}

    def record(node):
        bound[node.var] = node.value
        return node

    tvm_ffi.structural_map(func, [((tirx.Bind, tirx.Let), record)])
    return bound


class _Sizes:
    """Whether an integer expression is built only from sizes and non-negative constants."""

    def __init__(self, sizes: set[tirx.Var], bound: dict[tirx.Var, tirx.PrimExpr]) -> None:
        self.sizes, self.bound = sizes, bound
        self._known: dict[tirx.Var, bool] = {}

    def __call__(self, expr: tirx.PrimExpr) -> bool:
        if isinstance(expr, tirx.IntImm):
            return expr.value >= 0
        if isinstance(expr, tirx.Var):
            return self._var(expr)
        if isinstance(expr, tirx.Cast):
            return expr.ty.dtype.startswith("int") and self(expr.value)
        if isinstance(expr, _CLOSED):
            return self(expr.a) and self(expr.b)
        return False

    def _var(self, var: tirx.Var) -> bool:
        if var in self.sizes:
            return True
        if var not in self._known:
            self._known[var] = False  # a binding that refers to itself is no size
            value = self.bound.get(var)
            self._known[var] = value is not None and self(value)
        return self._known[var]


class _Hoist:
    """The divisions by sizes in a loop that do not change in it, each replaced by a new variable
    whose value (the division, by ``max(divisor, 1)``) is computed before the loop."""

    def __init__(self, of_sizes: _Sizes, inside: set[tirx.Var]) -> None:
        self.of_sizes, self.inside = of_sizes, inside
        self.values: list[tuple[tirx.Var, tirx.PrimExpr]] = []

    def __call__(self, node: tirx.PrimExpr) -> tirx.PrimExpr:
        divisor = node.b
        dtype = divisor.ty.dtype
        if isinstance(divisor, tirx.IntImm) or not dtype.startswith("int") or "x" in dtype:
            return node
        if not self.of_sizes(divisor) or any(v in self.inside for v in tirx.analysis.undefined_vars(node)):
            return node  # not by a size, or changes in the loop: stays where it is
        var = tirx.Var(f"{type(node).__name__.lower()}{len(self.values)}", dtype)
        self.values.append((var, type(node)(node.a, tirx.Max(divisor, tirx.IntImm(dtype, 1)))))
        return var


def _defined_in(node: tirx.Stmt) -> set[tirx.Var]:
    """The variables a statement defines (loops, bindings) itself."""
    defined: set[tirx.Var] = set()

    def record(n):
        defined.add(n.loop_var if isinstance(n, tirx.For) else n.var)
        return n

    tvm_ffi.structural_map(node, [((tirx.For, tirx.Bind, tirx.Let), record)])
    return defined


def with_speculable_divisions(func: tirx.PrimFunc, sizes: set[tirx.Var]) -> tirx.PrimFunc:
    """``func`` with every division and remainder by a scalar integer built from ``sizes`` (not a
    constant) that does not change in a loop computed before the loop, by ``max(divisor, 1)``
    (innermost loops first: a division rises to the outermost loop it does not change in)."""
    of_sizes = _Sizes(sizes, _bindings(func))

    def loop(node: tirx.For) -> tirx.Stmt:
        hoist = _Hoist(of_sizes, _defined_in(node))
        mapped = tvm_ffi.structural_map(node, [(_DIVISIONS, hoist)])
        if not hoist.values:
            return node
        return tirx.SeqStmt([*(tirx.Bind(var, value) for var, value in hoist.values), mapped])

    return tvm_ffi.structural_map(func, [(tirx.For, loop)])


def _pipeline(**kwargs):
    """TVM's default TIR pipeline, then :func:`with_speculable_divisions` (before the host's
    finalizing passes, which lower the divisions to LLVM's)."""
    lower, finalize_host, finalize_device = tirx.get_tir_pipeline("default", **kwargs)

    @tvm.transform.module_pass(opt_level=0, name="tvmbridge.SpeculableDivisions")
    def pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        sizes = size_vars(mod)
        mod = lower(mod)
        funcs = {
            gv: with_speculable_divisions(f, sizes) if isinstance(f, tirx.PrimFunc) else f
            for gv, f in mod.functions_items()
        }
        return tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos)

    return pipeline, finalize_host, finalize_device


tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)  # a name of the bridge's own
