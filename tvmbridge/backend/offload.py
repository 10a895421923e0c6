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
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from ..ir import RewriteBindings, Rule, evaluate_dim, is_op, static_shape
from ..kernels.gemm import GemmSpec, register_gemms
from ..options import GEMM_BACKENDS
from .gemm_choice import ChoiceCache, GemmChooser, GemmDecision, GemmProblem


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
    try:
        a_shape = tuple(evaluate_dim(d, sizes) for d in _shape(a))
        b_shape = tuple(evaluate_dim(d, sizes) for d in _shape(b))
    except (KeyError, TypeError):
        return None
    return GemmProblem(dtype, a_shape, b_shape, ta, tb)


def _offload_rule(chooser: GemmChooser, sizes: dict[str, int], decisions: list[GemmDecision]) -> Rule:
    def rule(value: relax.Expr, bound: dict) -> relax.Expr | None:
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
        problem = _problem(dtype, a, b, ta, tb, sizes)
        if problem is None or 0 in problem.a_shape or 0 in problem.b_shape:
            library = "torch"
        else:
            decision = chooser.choose(problem)
            decisions.append(decision)
            library = decision.library
        return relax.op.call_pure_packed(
            GemmSpec(library, ta, tb).name, a, b, ty_args=relax.TensorType(out_shape, dtype)
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
            if spec is None or spec.bias or uses.get(mm, 0) != 1:
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


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.OffloadMatmuls")
class OffloadMatmuls:
    """Every float ``R.matmul`` (:data:`OFFLOADED_DTYPES`) (static or symbolic shapes) becomes a call of a GEMM library
    (``backend``: ``"auto"`` measures each distinct GEMM, see ``gemm_choice``; ``"torch"`` or
    ``"onednn"`` fix it); a following bias add folds into ``addmm``. ``sizes``: the compiling
    call's symbolic dims, at which a symbolic GEMM is measured. :attr:`decisions` says where
    each GEMM went and why."""

    def __init__(self, backend: str = "auto", sizes: dict[str, int] | None = None,
                 cache: ChoiceCache | None = None) -> None:
        if backend not in GEMM_BACKENDS:
            raise ValueError(f"unknown matmul backend {backend!r}; expected one of {GEMM_BACKENDS}")
        self.backend = backend
        self.sizes = dict(sizes or {})
        self.cache = cache
        self.decisions: list[GemmDecision] = []

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        register_gemms()
        cache = self.cache if self.cache is not None else ChoiceCache() if self.backend == "auto" else None
        chooser = GemmChooser(self.backend, cache)
        mod = relax.transform.Normalize()(mod)
        rules = [_offload_rule(chooser, self.sizes, self.decisions), _bias_rule(_use_counts(mod))]
        mod = RewriteBindings(rules)(mod)
        return relax.transform.DeadCodeElimination()(mod)


def offloaded_gemms(func: relax.Function) -> list[tuple[GemmSpec, list[tuple[int, ...]]]]:
    """Every offloaded call in ``func`` as ``(spec, operand shapes)``, in program order: what
    ``scripts/bench_train.py --gemm-table`` times on each library."""
    return [
        (spec, [static_shape(x) for x in b.value.args[1:]])
        for block in func.body.blocks for b in block.bindings
        if (spec := offloaded_call(b.value)) is not None
    ]
