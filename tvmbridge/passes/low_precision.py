"""Compute bfloat16/float16 math in float32, rounding each op's result, as PyTorch's kernels do.

Under autocast the graph holds bfloat16 (or float16) values between ops. PyTorch computes each
such op in float32 ("opmath") and rounds its result once: a bfloat16 ``sum`` accumulates in
float32, a bfloat16 ``exp`` evaluates in float32. TVM's kernels would compute in the low
dtype itself (a bfloat16 running sum loses all but 8 bits) or refuse (``power`` on bfloat16).
This pass rewrites every op with a low-precision tensor argument or result to
``astype(op(astype(args, float32)), low)``: the casts fuse into the op's kernel, the rounding
of the result stays, so values between ops are exactly what eager autocast keeps.

Offloaded GEMMs are left alone (the GEMM libraries accumulate in float32, add a bias and round
once, as eager's ``addmm`` does: so the pass runs after the offload has folded bias adds into
them); a matmul TVM runs itself keeps its low-precision operands with a float32 accumulator. Ops
that only move data are left alone (exact in any dtype).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import Call, Expr, expr_functor

LOW_PRECISION = ("bfloat16", "float16")

# exact in any dtype, or run by a library in the low dtype on purpose
_KEEP = frozenset(
    {
        "relax.astype",
        "relax.reshape",
        "relax.permute_dims",
        "relax.expand_dims",
        "relax.squeeze",
        "relax.flatten",
        "relax.broadcast_to",
        "relax.concat",
        "relax.split",
        "relax.strided_slice",
        "relax.dynamic_strided_slice",
        "relax.take",
        "relax.gather_elements",
        "relax.gather_nd",
        "relax.tile",
        "relax.flip",
        "relax.repeat",
        "relax.layout_transform",
        "relax.where",
        "relax.stop_gradient",
        "relax.zeros_like",
        "relax.ones_like",
        "relax.full_like",
        "relax.zeros",
        "relax.ones",
        "relax.full",
        "relax.scatter_elements",
        "relax.scatter_nd",
    }
)


def _dtype(expr: Expr) -> str | None:
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


@expr_functor.mutator
class _Float32Opmath(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, elide_rounding: bool) -> None:
        super().__init__(mod)
        self.rewritten = 0
        self.elide_rounding = elide_rounding

    def _widened(self, value: Expr) -> Expr:
        """``value`` in float32: the float32 result it was rounded from, where it is one (a
        chain of elementwise ops stays in float32, rounded where PyTorch or a GEMM reads it),
        else ``value`` converted."""
        bound = self.lookup_binding(value) if isinstance(value, relax.Var) else None
        if (
            isinstance(bound, Call)
            and getattr(bound.op, "name", "") == "relax.astype"
            and _dtype(bound.args[0]) == "float32"
            and self.elide_rounding
        ):
            return bound.args[0]
        return relax.op.astype(value, "float32")

    def visit_call_(self, call: Call) -> Expr:
        call = relax.PyExprMutator.visit_call_(self, call)
        op = getattr(call, "op", None)
        if not isinstance(op, tvm.ir.Op) or op.name in _KEEP or op.name.startswith("relax.call_") or call.ty_args:
            return call
        args = list(call.args)
        low = [a for a in args if _dtype(a) in LOW_PRECISION]
        out = _dtype(call)
        if op.name == "relax.matmul":  # not offloaded: low-precision operands, float32 accumulator
            if out not in LOW_PRECISION:
                return call
            self.rewritten += 1
            wide = self.builder_.emit(relax.op.matmul(args[0], args[1], out_dtype="float32"))
            return relax.op.astype(wide, out)
        fields = list(call.ty.fields) if isinstance(call.ty, relax.TupleType) else []
        low_fields = [getattr(f, "dtype", None) in LOW_PRECISION for f in fields]
        if not low and out not in LOW_PRECISION and not any(low_fields):
            return call
        new_args = [self._widened(a) if _dtype(a) in LOW_PRECISION else a for a in args]
        wide = self.builder_.normalize(Call(call.op, new_args, call.attrs, call.ty_args, call.span))
        self.rewritten += 1
        if out in LOW_PRECISION:
            return relax.op.astype(self.builder_.emit(wide), out)
        if any(low_fields):  # a tuple (top-k's values and indices): each low field rounded back
            both = self.builder_.emit(wide)
            items = [self.builder_.emit(relax.TupleGetItem(both, i)) for i in range(len(fields))]
            return relax.Tuple(
                [relax.op.astype(v, str(f.dtype)) if lo else v for v, f, lo in zip(items, fields, low_fields)]
            )
        return wide


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.Float32Opmath")
class Float32Opmath:
    """Every Relax function's low-precision math computed in float32 and rounded per op (see the
    module docstring); a module without bfloat16/float16 values is returned unchanged.
    ``elide_rounding``: an op reading another's rounded result reads its float32 value instead."""

    def __init__(self, elide_rounding: bool = True) -> None:
        self.elide_rounding = elide_rounding

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updated = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
        for gvar, func in mod.functions.items():
            if isinstance(func, relax.Function):
                mutator = _Float32Opmath(mod, self.elide_rounding)
                new = mutator.visit_expr(func)
                if mutator.rewritten:
                    updated[gvar] = relax.transform.Normalize()(tvm.IRModule({gvar: new}))[gvar]
        return updated
