"""The reverse sweep: the adjoint of a one-block Relax function, built by the bridge.

Relax's ``Gradient`` pass does the same sweep (each binding's registered ``FPrimalGradient``,
last binding first) but, in TVM 0.27, where TIR and Relax variables share one class, its
checkpoint analysis counts every symbolic size in a call's type as an unknown Relax variable: no
binding downstream of a symbolic shape counts as kept, the whole forward is recomputed in the
backward (``lv_cp`` bindings, with types re-inferred and weaker), and a size passed as an argument
(``slice_scatter(x, y, 1, n, 1)``) fails with ``key is not in Map``. Here every forward value is
kept, with the types the frontend gave it, and the sweep visits only what a required parameter
reaches through float values (an integer path needs no gradient, and ops there need none
registered). The bridge's own gradients (``gradients.GRADIENTS``) are looked up first, then
TVM's; nothing is registered with TVM. The result has ``Gradient``'s layout: the forward
bindings, then the backward, returning ``(target, (grads...))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

import tvm
from tvm import relax

from ..errors import UnsupportedOpError
from ..ir import blocks_closed_on_error, only_dataflow_block, rebuild
from .gradients import GRADIENTS

NO_GRAD = tvm.ir.Op.get("relax.grad.no_grad")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")
MATMUL = tvm.ir.Op.get("relax.matmul")

Adjoint: TypeAlias = relax.Expr | list | None  # a tensor's adjoint, or per field of a tuple (None: zero)


def vjp_function(func: relax.Function, require: list[relax.Var], name: str) -> relax.Function:
    """``func`` (returning a float scalar) followed by its gradient w.r.t. ``require``: a
    function of the same params returning ``(target, (d target / d p for p in require))``."""
    block = only_dataflow_block(func, "gradient")
    target = func.body.body
    if not isinstance(target, relax.Var) or not _is_float_tensor(target.ty):
        raise UnsupportedOpError("gradient", "the target must be a float tensor variable")
    bb = relax.BlockBuilder()
    attrs = dict(func.attrs) if func.attrs else None
    with blocks_closed_on_error(bb), bb.function(name, list(func.params), attrs=attrs, pure=True):
        with bb.dataflow():
            for b in block.bindings:
                bb.emit_normalized(b)
            sweep = _Sweep(bb, _reached_by(block, require))
            sweep.add(target, relax.op.ones(target.ty.shape, str(target.ty.dtype)))
            for b in reversed(block.bindings):
                sweep.visit(b)
            grads = [bb.emit_output(sweep.materialize(p), name_hint=f"{p.name}_adjoint_out") for p in require]
        bb.emit_func_output(relax.Tuple([target, relax.Tuple(grads)]))
    adjoint = bb.get()[name]
    return _without_transposed_products(relax.analysis.remove_all_unused(adjoint))


def _is_float_tensor(ty: relax.Type) -> bool:
    return isinstance(ty, relax.TensorType) and str(ty.dtype).startswith(("float", "bfloat"))


def _carries_gradient(ty: relax.Type) -> bool:
    if isinstance(ty, relax.TupleType):
        return any(_carries_gradient(f) for f in ty.fields)
    return _is_float_tensor(ty)


def _reached_by(block: relax.DataflowBlock, require: list[relax.Var]) -> set[relax.Var]:
    """The float values that depend on a required parameter other than through ``no_grad``."""
    reached = set(require)
    for b in block.bindings:
        if isinstance(b.value, relax.Call) and b.value.op.same_as(NO_GRAD):
            continue
        if _carries_gradient(b.var.ty) and any(v in reached for v in relax.analysis.free_vars(b.value)):
            reached.add(b.var)
    return reached


def _gradient_of(op: tvm.ir.Op) -> Callable:
    fn = GRADIENTS.get(op.name) or op.get_attr("FPrimalGradient")
    if fn is None:
        raise UnsupportedOpError(
            "gradient",
            f"no gradient for {op.name}; register one in tvmbridge.passes.gradients (@gradient) or use fallback=True",
            op=op.name,
        )
    return fn


class _Sweep:
    """The adjoints of the values ``reached`` holds, accumulated while the bindings are visited
    last to first."""

    def __init__(self, bb: relax.BlockBuilder, reached: set[relax.Var]) -> None:
        self.bb, self.reached = bb, reached
        self.adjoints: dict[relax.Var, Adjoint] = {}

    def visit(self, binding: relax.VarBinding) -> None:
        var, value = binding.var, binding.value
        if var not in self.adjoints:
            return
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            if value.op.same_as(NO_GRAD):
                return
            grad = self.materialize(var)
            try:
                partials = _gradient_of(value.op)(var, value, grad, self.bb)
            except UnsupportedOpError:
                raise
            except Exception as exc:  # noqa: BLE001 - named with the op it came from
                raise UnsupportedOpError(
                    "gradient", f"the gradient of {value.op.name} failed at {var.name}: {exc}", op=value.op.name
                ) from exc
            for arg, partial in zip(value.args, partials):
                if not (isinstance(partial, relax.Call) and partial.op.same_as(NO_GRAD)):
                    self.add(arg, partial)
        elif isinstance(value, relax.Call):
            raise UnsupportedOpError("gradient", f"{var.name} calls a function, which has no gradient")
        elif isinstance(value, relax.TupleGetItem):
            fields = self._fields(value.tuple_value)
            if fields is not None:
                fields[value.index] = self._sum(fields[value.index], self.adjoints[var])
        else:  # a tuple of values, or an alias
            self.add(value, self.adjoints[var])

    def add(self, expr: relax.Expr, partial: Adjoint) -> None:
        """``adjoint(expr) += partial`` for a variable (or each leaf of a tuple) gradients reach."""
        if isinstance(expr, relax.Tuple):
            for i, field in enumerate(expr.fields):
                self.add(field, _field(partial, i, self.bb))
        elif isinstance(expr, relax.Var) and expr in self.reached and partial is not None:
            if isinstance(expr.ty, relax.TupleType):
                fields = self._fields(expr)
                assert fields is not None  # a var gradients reach
                for i in range(len(fields)):
                    fields[i] = self._sum(fields[i], _field(partial, i, self.bb))
            else:
                self.adjoints[expr] = self._sum(self.adjoints.get(expr), partial, expr.name)

    def _fields(self, var: relax.Expr) -> list | None:
        if not (isinstance(var, relax.Var) and var in self.reached):
            return None
        return self.adjoints.setdefault(var, [None] * len(var.ty.fields))

    def _sum(self, old: Adjoint, new: Adjoint, name: str = "tuple") -> Adjoint:
        if new is None:
            return old
        if isinstance(new, list) or isinstance(old, list):
            old = old if old is not None else [None] * len(new)
            return [self._sum(o, n) for o, n in zip(old, new)]
        value = new if old is None else relax.op.add(old, new)
        return self.bb.emit(value, name_hint=f"{name}_adjoint")

    def materialize(self, var: relax.Var) -> relax.Expr:
        """The adjoint of ``var`` as one expression: zeros where nothing reached it."""
        return _as_expr(self.adjoints.get(var), var.ty, self.bb)


def _field(partial: Adjoint, i: int, bb: relax.BlockBuilder) -> Adjoint:
    if partial is None or isinstance(partial, list):
        return None if partial is None else partial[i]
    if isinstance(partial, relax.Tuple):
        return partial.fields[i]
    return bb.emit(relax.TupleGetItem(bb.emit(partial), i))


def _as_expr(adjoint: Adjoint, ty: relax.Type, bb: relax.BlockBuilder) -> relax.Expr:
    if isinstance(ty, relax.TupleType):
        fields = adjoint if isinstance(adjoint, list) else [None] * len(ty.fields)
        return bb.emit(relax.Tuple([_as_expr(a, t, bb) for a, t in zip(fields, ty.fields)]))
    if adjoint is None:
        return bb.emit(relax.op.zeros(ty.shape, str(ty.dtype)))
    return adjoint


def _without_transposed_products(func: relax.Function) -> relax.Function:
    """``Gradient``'s own clean-up (``SimplifyGradient``): ``permute_dims(permute_dims(a))`` is
    ``a`` and ``permute_dims(matmul(a, b))`` is ``matmul(b^T, a^T)``, transposes of transposes
    dropped: a linear layer's weight gradient is then one matmul, not a matmul and a copy."""
    block = func.body.blocks[0]
    bound: dict[relax.Var, relax.Expr] = {}
    bindings: list[relax.VarBinding] = []
    changed = False
    for b in block.bindings:
        value = b.value
        inner = bound.get(value.args[0]) if _is_last_two_transpose(value) else None
        if inner is not None and _is_last_two_transpose(inner):
            value, changed = inner.args[0], True
        elif (
            inner is not None
            and isinstance(inner, relax.Call)
            and inner.op.same_as(MATMUL)
            and all(a.ty.ndim > 1 for a in inner.args)
        ):
            a, b_ = (_transposed(x, bound, bindings) for x in inner.args)
            value, changed = relax.Call(MATMUL, [b_, a], inner.attrs), True
        bound[b.var] = value
        bindings.append(relax.VarBinding(b.var, value))
    return (
        relax.analysis.remove_all_unused(rebuild(func, list(func.params), bindings, func.body.body))
        if changed
        else func
    )


def _is_last_two_transpose(value: relax.Expr) -> bool:
    if not (isinstance(value, relax.Call) and value.op.same_as(PERMUTE)):
        return False
    ndim = value.args[0].ty.ndim
    axes = value.attrs.axes
    if ndim < 2:
        return False
    if axes is None:
        return ndim == 2
    return [int(a) for a in axes] == list(range(ndim - 2)) + [ndim - 1, ndim - 2]


def _transposed(x: relax.Expr, bound: dict, bindings: list) -> relax.Expr:
    """``x^T`` (last two axes): the input of a transpose bound earlier, else a new binding."""
    prev = bound.get(x)
    if prev is not None and _is_last_two_transpose(prev):
        return prev.args[0]
    ndim = x.ty.ndim
    value = relax.op.permute_dims(x, list(range(ndim - 2)) + [ndim - 1, ndim - 2])
    shape = x.ty.shape
    ty = (
        relax.TensorType(None, str(x.ty.dtype), ndim=ndim)
        if shape is None
        else relax.TensorType([*list(shape.values)[:-2], shape[-1], shape[-2]], str(x.ty.dtype))
    )
    var = relax.DataflowVar(f"{x.name}_t", ty)
    bindings.append(relax.VarBinding(var, value))
    bound[var] = value
    return var
