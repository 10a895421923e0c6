"""Vectorizable float32 ``erf``/``exp``/``tanh`` (TVM's ``topi.fast_*``) for the built halves.

LLVM lowers ``erf`` and ``exp`` to scalar libm calls, which cannot be vectorized;
``topi.fast_erf`` and friends are polynomial approximations a few float32 ulps from libm (the
README gives the measured speed and error), far below float32 training noise. So on float32 only:
``nn.gelu`` is written as ``x/2 (1 + erf(x/sqrt2))``, ``erf``, ``exp``, ``tanh`` and
``softmax`` use the fast kernels, ``sigmoid`` is ``1 / (1 + exp(-x))`` with the fast ``exp`` (as
ATen's vectorized CPU kernel writes it; a SiLU network's largest elementwise kernels otherwise),
and ``log_softmax`` is written out with the fast ``exp``.
Float64 (where the checker compares against PyTorch at 1e-10) is never touched. It is the last
Relax step before legalization, after the split: the graphs the analyses see are unchanged.
Turn it off with ``add_tvm_dispatch(..., fast_math=False)``.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, topi
from tvm.relax import Call, Expr, expr_functor
from tvm.relax.transform.fast_math import FastMathCodeGenerator

from ..ir import static_shape


def _gelu_fast(x):
    inner = topi.fast_erf(topi.multiply(x, 1.0 / math.sqrt(2.0)))
    return topi.multiply(topi.multiply(x, 0.5), topi.add(inner, 1.0))


def _sigmoid_fast(x):
    """``1 / (1 + exp(-x))``; ``fast_exp`` clamps its argument to float32's range, so a very
    negative ``x`` gives a tiny positive value where libm's gives 0 or a subnormal."""
    e = topi.fast_exp(topi.negative(x))
    one = tvm.tirx.const(1.0, x.dtype)
    return te.compute(x.shape, lambda *i: one / (one + e(*i)), name="sigmoid", tag="elemwise")


_FAST = {
    "relax.exp": topi.fast_exp,
    "relax.sigmoid": _sigmoid_fast,
    "relax.erf": topi.fast_erf,
    "relax.tanh": topi.fast_tanh,
    "relax.nn.softmax": topi.nn.fast_softmax,
    "relax.nn.gelu": _gelu_fast,
}


@expr_functor.mutator
class _Float32FastMath(FastMathCodeGenerator._cls):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.kernels: dict[tuple, Call] = {}  # (op, shape, dtype, attributes) -> the first call of its kernel

    def fast_call(self, name: str, x: Expr, *attrs: int) -> Expr:
        """The fast kernel of ``name`` on ``x``; one kernel per op, shape and attributes (an
        unrolled recurrence has thousands of the same ``tanh``): TE's ``create_prim_func`` and the
        builder's structural deduplication of each copy were most of this pass's time."""
        shape = static_shape(x)
        key = (name, shape, str(x.ty.dtype), attrs)
        if shape is not None and (known := self.kernels.get(key)) is not None:
            return relax.Call(known.op, [known.args[0], relax.Tuple([x])], known.attrs, known.ty_args)
        call = self.builder_.call_te(_FAST[name], x, *attrs)
        if shape is not None and len(call.args) == 2:  # no size variables passed
            self.kernels[key] = call
        return call

    def visit_call_(self, call: Call) -> Expr:
        name = getattr(call.op, "name", "")
        if (
            name == "relax.nn.log_softmax"
            and str(call.args[0].ty.dtype) == "float32"
            and isinstance(call.args[0].ty.shape, relax.ShapeExpr)
        ):
            return _log_softmax(self.builder_, relax.PyExprMutator.visit_expr(self, call.args[0]), int(call.attrs.axis))
        if name in _FAST:
            x = call.args[0]
            # TE needs the shape written out (a symbolic value may carry only a shape variable)
            if str(x.ty.dtype) == "float32" and isinstance(x.ty.shape, relax.ShapeExpr):
                return self.fast_call(name, x, *([int(call.attrs.axis)] if name == "relax.nn.softmax" else []))
        return relax.PyExprMutator.visit_call_(self, call)


def _log_softmax(builder: relax.BlockBuilder, x: Expr, axis: int) -> Expr:
    """``(x - max) - log(sum(exp(x - max)))`` with the fast ``exp``: plain reductions and
    elementwise ops that fuse with their neighbours (a cast in front, the loss after), where
    TOPI's ``log_softmax`` is one opaque kernel with scalar libm calls. ``x - max`` is written
    twice, once into the sum's kernel and once into the output's, so that no kernel writes it out
    whole (one value read by two kernels is materialized); in ATen's order (``x - max`` first,
    then the log: adding the log to the max first loses digits of large logits)."""
    op = relax.op
    top = builder.emit(op.max(x, axis=[axis], keepdims=True))
    exp = builder.emit(builder.call_te(topi.fast_exp, builder.emit(op.subtract(x, top))))
    return op.subtract(op.subtract(x, top), op.log(op.sum(exp, axis=[axis], keepdims=True)))


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.FastMathFloat32")
def FastMathFloat32(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:  # noqa: N802
    """The float32 fast-math rewrite of every Relax function."""
    gen = _Float32FastMath(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            gen.builder_.update_func(gv, gen.visit_expr(func))
    return gen.builder_.get()
