"""Reverse-mode gradient of a module: the VJP target, the sweep (``reverse_mode``), clean-up.

The sweep differentiates a scalar. For a module with outputs ``o_i`` we differentiate
``sum_i sum(o_i * g_i)`` with the output gradients ``g_i`` as extra inputs: its gradient with
respect to any input is exactly the vector-Jacobian product autograd asks for. Gradients are asked
only for the inputs that can have one (float user inputs and parameters), so random inputs and
``g_i`` get none. Outputs that have no gradient (integer results, updated running statistics,
index-range flags) get no ``g_i``: they enter the target through ``no_grad``, which keeps them
alive in the adjoint (the split finds every output there) and lets nothing flow back. The
gradients Relax lacks are the bridge's own (``gradients``, ``gradients_nn``, ``gradients_conv``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax
from tvm.relax.op.grad import no_grad

from .. import names
from ..errors import ConversionError
from ..ir import binding_map, only_dataflow_block, rebuild, same_tensor_type
from . import (
    gradients_conv,  # noqa: F401 - fills gradients.GRADIENTS with those of conv, norm, pool ops
    gradients_nn,  # noqa: F401 - fills gradients.GRADIENTS with those of elementwise and layout ops
)
from .low_precision import LOW_PRECISION
from .reverse_mode import vjp_function

NO_GRAD, SUBTRACT, ASTYPE, ADD = (tvm.ir.Op.get(f"relax.{n}") for n in ("grad.no_grad", "subtract", "astype", "add"))


@dataclass(frozen=True)
class GradientResult:
    """The adjoint function and how its parameters are laid out.

    ``adjoint`` takes ``primal params + grad_outs`` and returns ``(target, (grads...))``, the
    grads in the order of the primal parameters asked for.
    """

    adjoint: relax.Function
    num_primal_params: int
    grad_out_params: list[relax.Var]  # one per differentiable output, in output order
    differentiable: tuple[bool, ...]  # per output
    repeats: dict[int, int] = field(default_factory=dict)  # output i is the value of output j < i


def _same_constant(a: relax.Expr, b: relax.Expr) -> bool:
    if not (isinstance(a, tvm.ir.expr.Constant) and isinstance(b, tvm.ir.expr.Constant)):
        return False
    x, y = a.value.numpy(), b.value.numpy()
    return x.dtype == y.dtype and x.shape == y.shape and bool((x == y).all())


def repeated_outputs(outputs: list[relax.Expr], differentiable: list[bool]) -> dict[int, int]:
    """Non-differentiable outputs that return an earlier output's value (one index flag for an
    embedding table read in every layer, one constant in every layer's cache): ``{i: j}``. They
    are left out of the VJP target, where common-subexpression elimination would merge their
    ``vjp_prod`` bindings anyway."""
    repeats: dict[int, int] = {}
    for i, o in enumerate(outputs):
        if differentiable[i]:
            continue
        j = next((j for j in range(i) if outputs[j].same_as(o) or _same_constant(outputs[j], o)), None)
        if j is not None:
            repeats[i] = repeats.get(j, j)
    return repeats


def function_outputs(func: relax.Function) -> list[relax.Expr]:
    """The tensors a frontend function returns (its result tuple, flattened one level)."""
    block = only_dataflow_block(func, "gradient")
    result = func.body.body
    value = binding_map(block).get(result, result) if isinstance(result, relax.Var) else result
    if isinstance(value, relax.Tuple):
        return list(value.fields)
    return [result]


def with_vjp_target(func: relax.Function, differentiable: list[bool], repeats: dict[int, int]) -> relax.Function:
    """``func`` returning ``target = sum_i sum(o_i * g_i)`` over the differentiable outputs (the
    ``g_i`` trailing params) plus ``sum(no_grad(o_j))`` over the others; the binding that reads
    output ``i`` is ``names.vjp_prod(i)``, which is how the split finds the outputs again;
    ``repeats`` (``repeated_outputs``) stay out."""
    block = only_dataflow_block(func, "gradient")
    outputs = function_outputs(func)
    bindings = list(block.bindings)
    for i, o in enumerate(outputs):
        if i in repeats:
            continue
        if isinstance(o, tvm.ir.expr.Constant) and not differentiable[i]:
            # a tensor the forward creates from nothing (a cache's ``torch.tensor(window)``):
            # computed (``max(c, c)``, which no simplification before the split folds back into
            # the constant) so that the split finds it like any output
            outputs[i] = relax.DataflowVar(f"constant_output{i}", o.ty)
            bindings.append(relax.VarBinding(outputs[i], relax.op.maximum(o, o)))
        if not isinstance(outputs[i], relax.Var) or not isinstance(outputs[i].ty, relax.TensorType):
            raise ConversionError("gradient", f"output {o} is not a tensor variable")
    # a float32 (float64 when an output is) target: Relax differentiates float32/float64 scalars
    # only, and bfloat16/float16 outputs (autocast) are summed in float32
    target_dtype = "float64" if any(str(o.ty.dtype) == "float64" for o in outputs) else "float32"
    grad_outs = [relax.Var(f"{names.GRAD_OUT}{i}", o.ty) for i, o in enumerate(outputs) if differentiable[i]]
    g = iter(grad_outs)
    total: relax.Expr | None = None
    for i, o in enumerate(outputs):
        if i in repeats:
            continue
        prod = relax.DataflowVar(names.vjp_prod(i), o.ty)
        if differentiable[i]:
            bindings.append(relax.VarBinding(prod, relax.op.multiply(o, next(g))))
            summed = relax.op.sum(prod if str(o.ty.dtype) == target_dtype else relax.op.astype(prod, target_dtype))
        else:
            bindings.append(relax.VarBinding(prod, no_grad(o)))
            summed = relax.op.sum(relax.op.astype(prod, target_dtype))
        part = relax.DataflowVar(f"vjp_sum{i}", relax.TensorType((), target_dtype))
        bindings.append(relax.VarBinding(part, summed))
        if total is None:
            total = part
        else:
            acc = relax.DataflowVar(f"vjp_acc{i}", relax.TensorType((), target_dtype))
            bindings.append(relax.VarBinding(acc, relax.op.add(total, part)))
            total = acc
    assert total is not None  # an output that is not a repeat: the first
    target = relax.Var("vjp_target", total.ty)
    bindings.append(relax.VarBinding(target, total))
    return rebuild(func, list(func.params) + grad_outs, bindings, target)


def build_adjoint(func: relax.Function, grad_param_indices: list[int], differentiable: list[bool]) -> GradientResult:
    """Differentiate ``func`` w.r.t. the params at ``grad_param_indices``; ``differentiable``
    says which outputs receive a gradient."""
    widened_func, widened = _widen_params(func, grad_param_indices)
    repeats = repeated_outputs(function_outputs(func), differentiable)
    target = with_vjp_target(widened_func, differentiable, repeats)
    adjoint = vjp_function(target, [target.params[i] for i in grad_param_indices], names.ADJOINT)
    if widened:
        adjoint = _narrow_params(adjoint, widened, grad_param_indices)
    adjoint = _without_no_grad(adjoint)
    return GradientResult(
        adjoint=adjoint,
        num_primal_params=len(func.params),
        grad_out_params=list(adjoint.params[len(func.params) :]),
        differentiable=tuple(differentiable),
        repeats=repeats,
    )


def _without_no_grad(adjoint: relax.Function) -> relax.Function:
    """Once differentiated, ``no_grad(x)`` is ``x``: each such binding becomes an alias, and the
    idiom ``t - no_grad(t)`` (a gradient path whose value is 0: BatchNorm's, see
    ``frontend/converters/normalization.py``) becomes zeros, cast zeros stay zeros and ``x + zeros`` is ``x``; so the
    forward computes nothing for such a path, and the capture policy sees plain arithmetic it may
    recompute. The VJP target's ``vjp_prod`` bindings keep their ``no_grad``: the split reads the
    outputs from them."""
    block = only_dataflow_block(adjoint, "gradient")
    stripped: dict[relax.Var, relax.Expr] = {}  # var bound to no_grad(x) -> x
    zeros: set[relax.Var] = set()
    bindings = []
    for b in block.bindings:
        var, value = b.var, b.value
        if _is_call(value, NO_GRAD) and names.vjp_prod_index(var.name) is None:
            value = stripped[var] = value.args[0]
        elif _is_zero_path(value, stripped) or (_is_call(value, ASTYPE) and value.args[0] in zeros):
            zeros.add(var)
            value = relax.op.zeros(var.ty.shape, str(var.ty.dtype))
        elif _is_call(value, ADD) and value.args[1] in zeros and same_tensor_type(value.args[0], var):
            value = value.args[0]
        bindings.append(b if value.same_as(b.value) else relax.VarBinding(var, value))
    if not stripped:
        return adjoint
    return rebuild(adjoint, list(adjoint.params), bindings, adjoint.body.body)


def _is_call(value: relax.Expr, op: tvm.ir.Op) -> bool:
    return isinstance(value, relax.Call) and value.op.same_as(op)


def _is_zero_path(value: relax.Expr, stripped: dict[relax.Var, relax.Expr]) -> bool:
    """``t - no_grad(t)``."""
    if not _is_call(value, SUBTRACT):
        return False
    t, other = value.args
    return other in stripped and stripped[other].same_as(t)


def _widen_params(func: relax.Function, indices: list[int]) -> tuple[relax.Function, dict[int, relax.Var]]:
    """Relax differentiates float32/float64 parameters only: each bfloat16/float16 one asked for
    becomes a float32 parameter read through a cast to its dtype (exact, the values being
    bfloat16/float16 ones). Returns the function and the original parameter at each position."""
    params, entry, widened = list(func.params), [], {}
    for i in indices:
        p = params[i]
        if isinstance(p.ty, relax.TensorType) and str(p.ty.dtype) in LOW_PRECISION:
            wide = relax.Var(p.name, relax.TensorType(p.ty.shape, "float32"))
            entry.append(relax.VarBinding(p, relax.op.astype(wide, str(p.ty.dtype))))
            params[i], widened[i] = wide, p
    if not widened:
        return func, widened
    block = only_dataflow_block(func, "gradient")
    return rebuild(func, params, entry + list(block.bindings), func.body.body), widened


def _narrow_params(adjoint: relax.Function, widened: dict[int, relax.Var], indices: list[int]) -> relax.Function:
    """The adjoint of a function :func:`_widen_params` changed, with the original parameter
    dtypes again: each widened parameter cast to float32 on entry, its gradient cast back."""
    params, entry = list(adjoint.params), []
    for i, original in widened.items():
        low = relax.Var(original.name, original.ty)
        entry.append(relax.VarBinding(params[i], relax.op.astype(low, "float32")))
        params[i] = low
    block = only_dataflow_block(adjoint, "gradient")
    bound = binding_map(block)
    result = adjoint.body.body
    result = bound.get(result, result) if isinstance(result, relax.Var) else result
    target, grads = result.fields
    grads = bound.get(grads, grads) if isinstance(grads, relax.Var) else grads
    fields, exits = list(grads.fields), []
    for k, i in enumerate(indices):
        if i in widened:
            narrow = relax.Var(f"{fields[k].name}_{widened[i].ty.dtype}", widened[i].ty)
            exits.append(relax.VarBinding(narrow, relax.op.astype(fields[k], str(widened[i].ty.dtype))))
            fields[k] = narrow
    out = relax.Tuple([target, relax.Tuple(fields)])
    return rebuild(adjoint, params, entry + list(block.bindings) + exits, out)
