"""Reverse-mode gradient of a module with Relax's ``Gradient`` pass.

``Gradient`` differentiates a scalar. For a module with outputs ``o_i`` we differentiate
``sum_i sum(o_i * g_i)`` with the output gradients ``g_i`` as extra inputs: its gradient with
respect to any input is exactly the vector-Jacobian product autograd asks for. Gradients are asked
only for the inputs that can have one (float user inputs and parameters), so masks and ``g_i``
get none.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax

from ..errors import ConversionError, UnsupportedOpError
from ._util import binding_map, only_dataflow_block, rebuild
from .registered_gradients import register_all


@dataclass
class GradientResult:
    """The adjoint function and how its parameters and results are laid out.

    ``adjoint`` takes ``primal params + grad_outs`` and returns ``(target, (grads...))``;
    ``output_vars`` are the primal outputs inside it (what the forward half returns);
    ``grad_param_indices`` are the primal parameter positions the grads belong to, in order.
    """

    adjoint: relax.Function
    num_primal_params: int
    output_vars: list[relax.Var]
    grad_out_params: list[relax.Var]
    grad_param_indices: list[int]


def function_outputs(func: relax.Function) -> list[relax.Expr]:
    """The tensors a frontend function returns (its result tuple, flattened one level)."""
    block = only_dataflow_block(func, "gradient")
    result = func.body.body
    value = binding_map(block).get(result, result) if isinstance(result, relax.Var) else result
    if isinstance(value, relax.Tuple):
        return list(value.fields)
    return [result]


def with_vjp_target(func: relax.Function) -> tuple[relax.Function, list[relax.Var], list[relax.Var]]:
    """Append ``target = sum_i sum(o_i * g_i)`` to ``func``; ``g_i`` become trailing params."""
    block = only_dataflow_block(func, "gradient")
    outputs = function_outputs(func)
    for o in outputs:
        if not isinstance(o, relax.Var) or not isinstance(o.ty, relax.TensorType):
            raise ConversionError("gradient", f"output {o} is not a tensor variable")
    grad_outs = [relax.Var(f"grad_out{i}", o.ty) for i, o in enumerate(outputs)]
    bindings = list(block.bindings)
    total: relax.Expr | None = None
    for i, (o, g) in enumerate(zip(outputs, grad_outs)):
        dt = str(o.ty.dtype)
        prod = relax.DataflowVar(f"vjp_prod{i}", o.ty)
        bindings.append(relax.VarBinding(prod, relax.op.multiply(o, g)))
        part = relax.DataflowVar(f"vjp_sum{i}", relax.TensorType((), dt))
        bindings.append(relax.VarBinding(part, relax.op.sum(prod)))
        if total is None:
            total = part
        else:
            acc = relax.DataflowVar(f"vjp_acc{i}", relax.TensorType((), dt))
            bindings.append(relax.VarBinding(acc, relax.op.add(total, part)))
            total = acc
    target = relax.Var("vjp_target", total.ty)
    bindings.append(relax.VarBinding(target, total))
    new = rebuild(func, list(func.params) + grad_outs, bindings, target)
    return new, outputs, grad_outs


def build_adjoint(func: relax.Function, grad_param_indices: list[int]) -> GradientResult:
    """Differentiate ``func`` w.r.t. the params at ``grad_param_indices``."""
    register_all()
    target_func, outputs, grad_outs = with_vjp_target(func)
    mod = tvm.IRModule({"main": target_func})
    mod = relax.transform.Normalize()(mod)
    require = [mod["main"].params[i] for i in grad_param_indices]
    try:
        mod = relax.transform.Gradient("main", require_grads=require, target_index=0)(mod)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        op = None
        for line in msg.splitlines():
            if "gradient" in line.lower() and "relax." in line:
                op = line[line.index("relax."):].split()[0].strip("`'\".,")
                break
        raise UnsupportedOpError(
            "gradient", f"Relax could not differentiate the module: {msg.splitlines()[-1] if msg else exc}; "
            "register a gradient with tvm.relax.op.register_gradient or use fallback=True", op=op,
        ) from exc
    adjoint = mod["main_adjoint"]
    # ``Gradient`` keeps the var objects of the primal bindings, so the outputs are found by identity.
    return GradientResult(
        adjoint=adjoint,
        num_primal_params=len(func.params),
        output_vars=outputs,
        grad_out_params=list(adjoint.params[len(func.params):]),
        grad_param_indices=list(grad_param_indices),
    )
