"""Offload dense matmuls to the GEMM libraries PyTorch ships, through ``R.call_pure_packed``.

Untuned TVM matmuls on CPU are naive loops. This is the pattern TVM itself uses for
cuBLAS/CUTLASS: the Relax matmul becomes a call of a registered packed function
(``kernels/gemm.py``) on zero-copy views of TVM's tensors, whose result comes back the same way.
Transposes feeding a matmul fold into flags, and a bias add into the call. Everything around the
matmuls stays in TVM and is fused there.

Backends, chosen per matmul at compile time (``backend=``): ``"torch"`` (``torch.matmul``, MKL on
x86), ``"onednn"`` (oneDNN's inner product where it fits, else ``torch``), ``"auto"`` (each
distinct GEMM timed on every library that fits it, on this machine, the choice cached on disk:
``gemm_choice``).

Deciding and rewriting are apart, so that the rewrite is a pure function of the module and a
plan: :func:`gemm_problems` lists what the chooser must decide (pure), the chooser decides (the
only step that times or touches its disk cache), :func:`plan_offload` turns its choices into an
:class:`OffloadPlan` (an immutable value: one library per matmul, with the reason, pure), and
:class:`ApplyOffloadPlan` rewrites the module by that plan and does nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax

from ..ir import RewriteBindings, Rule, evaluate_dim, is_op, static_shape
from ..kernels.gemm import GemmSpec
from .gemm_choice import GemmDecision, GemmProblem


def _dims(expr: relax.Expr) -> tuple[int, ...] | None:
    """A tensor's dims for the library choice: ints, -1 for a symbolic one (never empty: calls
    with empty tensors run PyTorch)."""
    ty = getattr(expr, "ty", None)
    if not (isinstance(ty, relax.TensorType) and ty.shape is not None and isinstance(ty.shape, relax.ShapeExpr)):
        return None
    return tuple(int(d.value) if isinstance(d, tvm.tirx.IntImm) else -1 for d in ty.shape.values)


def _shape(expr: relax.Expr) -> list | None:
    """The Relax shape of a tensor expression (ints and TIR expressions), if written out."""
    ty = getattr(expr, "ty", None)
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def _swaps_last_two(value: relax.Expr) -> bool:
    if not is_op(value, "relax.permute_dims"):
        return False
    shape = _dims(value.args[0])
    if shape is None or len(shape) < 2:
        return False
    n = len(shape)
    axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None else list(reversed(range(n)))
    return axes == list(range(n - 2)) + [n - 1, n - 2]


def _operand(expr: relax.Expr, bound: dict) -> tuple[relax.Expr, bool]:
    """The matmul operand with a last-two-dims transpose folded into a flag."""
    value = bound.get(expr) if isinstance(expr, relax.Var) else expr
    if value is not None and _swaps_last_two(value):
        return value.args[0], True
    return expr, False


def offloaded_call(value: relax.Expr) -> GemmSpec | None:
    """The spec of a ``call_pure_packed`` of one of the bridge's GEMMs, else None."""
    if not isinstance(value, relax.Call) or not is_op(value, "relax.call_pure_packed"):
        return None
    return GemmSpec.parse(str(value.args[0].global_symbol))


# bfloat16/float16 come from autocast: the libraries accumulate in float32 and round once, as
# eager autocast's GEMMs do
OFFLOADED_DTYPES = ("float32", "float64", "bfloat16", "float16")


def _problem(dtype: str, a: relax.Expr, b: relax.Expr, ta: bool, tb: bool, sizes: dict[str, int]) -> GemmProblem | None:
    """The GEMM as the chooser times it: symbolic dims at this compile's sizes (None if unknown)."""
    a_dims, b_dims = _shape(a), _shape(b)
    if a_dims is None or b_dims is None:
        return None
    try:
        a_shape = tuple(evaluate_dim(d, sizes) for d in a_dims)
        b_shape = tuple(evaluate_dim(d, sizes) for d in b_dims)
    except (KeyError, TypeError):
        return None
    return GemmProblem(dtype, a_shape, b_shape, ta, tb)


@dataclass(frozen=True)
class GemmSite:
    """A matmul as the pass finds it in the IR, the transposes feeding it folded into flags:
    what a plan's entries are looked up by. Dims are written as in Relax (a symbolic one by its
    name), so the same GEMM in the forward and the backward is one site."""

    dtype: str
    a_shape: tuple[str, ...]
    b_shape: tuple[str, ...]
    trans_a: bool
    trans_b: bool


@dataclass(frozen=True)
class PlannedGemm:
    """One matmul's library and why; ``decision``: the chooser's, where it was asked (None where
    the GEMM could not be posed at this compile's sizes, or is empty: those run ``torch``)."""

    site: GemmSite
    library: str
    reason: str
    decision: GemmDecision | None = None


@dataclass(frozen=True)
class OffloadPlan:
    """Which library runs each offloaded matmul of a module, one entry per matmul in program
    order: an immutable value, made by :func:`plan_offload`, applied by :class:`ApplyOffloadPlan`."""

    gemms: tuple[PlannedGemm, ...] = ()

    @property
    def decisions(self) -> tuple[GemmDecision, ...]:
        """The chooser's decisions, one per matmul it was asked about, in program order: what
        ``explain``, the compile report and the benchmarks show."""
        return tuple(g.decision for g in self.gemms if g.decision is not None)

    def libraries(self) -> dict[GemmSite, str]:
        """Each site's library (the same GEMM always gets the same one)."""
        return {g.site: g.library for g in self.gemms}


@dataclass(frozen=True)
class _Site:
    """A matched matmul: its site, the operands the library gets, and the output's shape."""

    site: GemmSite
    a: relax.Expr
    b: relax.Expr
    out_shape: list


def _match(value: relax.Expr, bound: dict) -> _Site | None:
    """The offloadable matmul ``value`` is (float, operands of rank >= 2 with shapes), else None."""
    if not is_op(value, "relax.matmul") or getattr(value, "ty", None) is None:
        return None
    a, b = value.args
    out_shape, a_shape, b_shape = _shape(value), _dims(a), _dims(b)
    if out_shape is None or a_shape is None or b_shape is None or len(a_shape) < 2 or len(b_shape) < 2:
        return None
    dtype = str(value.ty.dtype)
    if dtype not in OFFLOADED_DTYPES or str(a.ty.dtype) != dtype or str(b.ty.dtype) != dtype:
        return None
    (a, ta), (b, tb) = _operand(a, bound), _operand(b, bound)
    a_dims, b_dims = _shape(a), _shape(b)
    assert a_dims is not None and b_dims is not None  # as _dims saw them (a transpose's input: _swaps_last_two)
    site = GemmSite(dtype, tuple(map(str, a_dims)), tuple(map(str, b_dims)), ta, tb)
    return _Site(site, a, b, out_shape)


def _matmuls(mod: tvm.IRModule) -> Iterator[_Site]:
    """Every offloadable matmul of ``mod`` (normalized), in the order the pass rewrites them:
    functions in module order, bindings in program order (single-block functions, as
    ``RewriteBindings``)."""
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        body = func.body
        if not isinstance(body, relax.SeqExpr) or len(body.blocks) != 1:
            continue
        bound: dict[relax.Var, relax.Expr] = {}
        for b in body.blocks[0].bindings:
            bound[b.var] = b.value
            if (found := _match(b.value, bound)) is not None:
                yield found


def _posed(found: _Site, sizes: Mapping[str, int]) -> tuple[GemmProblem | None, str]:
    """The GEMM the chooser decides for a matmul at ``sizes``, or None and why it runs ``torch``
    undecided."""
    site = found.site
    problem = _problem(site.dtype, found.a, found.b, site.trans_a, site.trans_b, dict(sizes))
    if problem is None:
        return None, "a dim unknown at this compile's sizes"
    if 0 in problem.a_shape or 0 in problem.b_shape:
        return None, "an empty operand"
    return problem, ""


def gemm_problems(mod: tvm.IRModule, sizes: Mapping[str, int]) -> list[GemmProblem]:
    """The distinct GEMMs the chooser must decide for ``mod`` at ``sizes``, in program order."""
    posed = (_posed(found, sizes)[0] for found in _matmuls(relax.transform.Normalize()(mod)))
    return list(dict.fromkeys(p for p in posed if p is not None))


def plan_offload(
    mod: tvm.IRModule, sizes: Mapping[str, int], choices: Mapping[GemmProblem, GemmDecision]
) -> OffloadPlan:
    """The plan for ``mod``: each matmul on the library ``choices`` (the chooser's decisions for
    :func:`gemm_problems`) gives its GEMM at ``sizes``, ``torch`` where none can be posed. Pure:
    it measures nothing and reads nothing but its arguments."""
    gemms = []
    for found in _matmuls(relax.transform.Normalize()(mod)):
        problem, why = _posed(found, sizes)
        if problem is None:
            gemms.append(PlannedGemm(found.site, "torch", why))
        elif problem not in choices:
            raise KeyError(f"no library chosen for the GEMM {problem.key} (choose every gemm_problems entry)")
        else:
            decision = choices[problem]
            gemms.append(PlannedGemm(found.site, decision.library, decision.reason, decision))
    return OffloadPlan(tuple(gemms))


def _offload_rule(libraries: Mapping[GemmSite, str]) -> Rule:
    def rule(value: relax.Expr, bound: dict) -> relax.Expr | None:
        found = _match(value, bound)
        if found is None:
            return None
        if found.site not in libraries:
            raise ValueError(
                f"the offload plan has no library for the matmul {found.site} (a plan made for another module?)"
            )
        spec = GemmSpec(libraries[found.site], found.site.trans_a, found.site.trans_b)
        return relax.op.call_pure_packed(
            spec.name, found.a, found.b, ty_args=relax.TensorType(found.out_shape, found.site.dtype)
        )

    return rule


def _bias_rule(uses: dict[relax.Var, int]) -> Rule:
    """``add(bias, mm)`` over a 2-D offloaded matmul used only there, with a 1-D bias of the
    output's last dim: one ``addmm``."""

    def rule(value: relax.Expr, bound: dict) -> relax.Expr | None:
        if not is_op(value, "relax.add") or getattr(value, "ty", None) is None:
            return None
        for mm, bias in (value.args, reversed(value.args)):
            call = bound.get(mm) if isinstance(mm, relax.Var) else None
            spec = offloaded_call(call)
            if call is None or spec is None or spec.bias or uses.get(mm, 0) != 1:
                continue
            out, bias_shape, mm_shape = _shape(value), _shape(bias), _shape(mm)
            if out is None or len(out) != 2 or bias_shape is None or mm_shape is None:
                continue
            if not (tvm_ffi.structural_equal(bias_shape, [out[1]]) and tvm_ffi.structural_equal(mm_shape, out)):
                continue
            if str(bias.ty.dtype) != str(value.ty.dtype):
                continue
            addmm = GemmSpec(spec.library, spec.trans_a, spec.trans_b, bias=True)
            return relax.op.call_pure_packed(
                addmm.name, call.args[1], call.args[2], bias, ty_args=relax.TensorType(out, str(value.ty.dtype))
            )
        return None

    return rule


def _use_counts(mod: tvm.IRModule) -> dict[relax.Var, int]:
    uses: dict[relax.Var, int] = {}
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for block in func.body.blocks:
                for b in block.bindings:
                    for v in relax.analysis.free_vars(b.value):
                        uses[v] = uses.get(v, 0) + 1
            for v in relax.analysis.free_vars(func.body.body):
                uses[v] = uses.get(v, 0) + 1
    return uses


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.ApplyOffloadPlan")
class ApplyOffloadPlan:
    """Every matmul of the plan (float ``R.matmul``, :data:`OFFLOADED_DTYPES`, static or symbolic
    shapes) becomes a call of the GEMM library the plan gives it; a following bias add folds into
    ``addmm``. It does nothing else: no timing, no cache, no I/O, so applying one plan to one
    module twice gives structurally equal modules. A matmul the plan does not know is an error."""

    def __init__(self, plan: OffloadPlan) -> None:
        self.plan = plan

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = relax.transform.Normalize()(mod)
        rules = [_offload_rule(self.plan.libraries()), _bias_rule(_use_counts(mod))]
        mod = RewriteBindings(rules)(mod)  # type: ignore[operator]  # module_pass: a pass constructor, unseen by mypy
        return relax.transform.DeadCodeElimination()(mod)


def offloaded_gemms(func: relax.Function) -> list[tuple[GemmSpec, list[tuple[int, ...] | None]]]:
    """Every offloaded call in ``func`` as ``(spec, operand shapes)`` (None: symbolic), in program order: what
    ``scripts/bench_train.py --gemm-table`` times on each library."""
    return [
        (spec, [static_shape(x) for x in b.value.args[1:]])
        for block in func.body.blocks
        for b in block.bindings
        if (spec := offloaded_call(b.value)) is not None
    ]
