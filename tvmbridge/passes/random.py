"""Random values become function inputs: every ``RANDOM_SITE`` marker the importer emitted is
replaced by a new trailing parameter ``random{i}``.

The values are drawn by PyTorch at every call, in graph order, exactly as PyTorch's own op would
draw them (``runtime/random.py``); a dropout's input holds the scaled mask, so the importer's
``x * mask`` is the very floating-point operation PyTorch performs. Random values are inputs, not
captured values: the backward reads them like any other input and recomputation stays exact.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .. import names
from ..ir import is_op, only_dataflow_block, rebuild


def site_index(value: relax.Expr) -> int | None:
    """The site number of a ``RANDOM_SITE`` marker call, else None."""
    if not is_op(value, "relax.call_pure_packed") or str(value.args[0].global_symbol) != names.RANDOM_SITE:
        return None
    return int(value.args[1].value)


def externalize_random(func: relax.Function) -> relax.Function:
    """Every marker of ``func`` becomes a trailing parameter, in site order."""
    block = only_dataflow_block(func, "random")
    inputs: dict[int, relax.Var] = {}
    bindings: list[relax.Binding] = []
    for b in block.bindings:
        index = site_index(b.value)
        if index is None:
            bindings.append(b)
            continue
        param = relax.Var(f"{names.RANDOM_INPUT}{index}", b.var.ty)
        inputs[index] = param
        bindings.append(relax.VarBinding(b.var, param))
    if not inputs:
        return func
    if sorted(inputs) != list(range(len(inputs))):
        raise ValueError(f"random sites {sorted(inputs)} are not numbered 0..{len(inputs) - 1}")
    return rebuild(func, list(func.params) + [inputs[i] for i in range(len(inputs))], bindings, func.body.body)


@relax.transform.function_pass(opt_level=0, name="tvmbridge.ExternalizeRandom")
class ExternalizeRandom:
    """Random-site markers become function parameters."""

    def transform_function(
        self, func: relax.Function, mod: tvm.IRModule, ctx: tvm.transform.PassContext
    ) -> relax.Function:
        return externalize_random(func)
