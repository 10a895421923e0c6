"""Dropout externalization: ``R.nn.dropout(x, p)`` becomes ``x * mask`` with ``mask`` a new
function input.

The mask is drawn by PyTorch at every call, in graph order, exactly as PyTorch's own dropout
draws it on that device (``runtime/masks.py``), and already holds the ``1/(1-p)`` scale, as
PyTorch's does: the product ``x * mask`` is then the very floating point operation PyTorch
performs. Masks are inputs, not captured values: the backward reads them like any other input and
recomputation stays exact. Where the masks are and what they drop is read back from the function
itself (:func:`dropout_sites`): the mask parameters and the attribute :data:`RATES_ATTR`.
"""
from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.ir import Op

from .. import names
from .ir import only_dataflow_block, rebuild

_DROPOUT = Op.get("relax.nn.dropout")
RATES_ATTR = "tvmbridge.dropout_rates"  # drop probability of each mask parameter, in order


@dataclass(frozen=True)
class DropoutSite:
    """One training dropout: the mask input's shape, dtype and drop probability."""

    shape: tuple[int, ...]
    dtype: str
    p: float


def externalize_dropout(func: relax.Function) -> relax.Function:
    """Replace every ``R.nn.dropout`` with a multiply by a new trailing parameter
    ``dropout_mask{i}``; the rates go to the function attribute :data:`RATES_ATTR`."""
    block = only_dataflow_block(func, "dropout")
    masks: list[relax.Var] = []
    rates: list[float] = []
    bindings: list[relax.Binding] = []
    for b in block.bindings:
        value = b.value
        if not (isinstance(value, relax.Call) and value.op.same_as(_DROPOUT)):
            bindings.append(b)
            continue
        x = value.args[0]
        ty = relax.TensorType(tuple(int(s) for s in x.ty.shape), str(x.ty.dtype))
        mask = relax.Var(f"{names.DROPOUT_MASK}{len(masks)}", ty)
        masks.append(mask)
        rates.append(float(value.attrs.rate))
        out = relax.DataflowVar(f"{b.var.name}_dropped", ty)
        bindings.append(relax.VarBinding(out, relax.op.multiply(x, mask)))
        bindings.append(relax.VarBinding(b.var, relax.Tuple([out, mask])))
    if not masks:
        return func
    new = rebuild(func, list(func.params) + masks, bindings, func.body.body)
    return new.with_attr(RATES_ATTR, [tvm.tirx.FloatImm("float64", r) for r in rates])


def dropout_sites(func: relax.Function) -> list[DropoutSite]:
    """The masks :func:`externalize_dropout` added to ``func``, in parameter order."""
    rates = func.attrs.get(RATES_ATTR) if func.attrs is not None else None
    if not rates:
        return []
    masks = func.params[len(func.params) - len(rates):]
    return [
        DropoutSite(tuple(int(s) for s in m.ty.shape), str(m.ty.dtype), float(r.value))
        for m, r in zip(masks, rates)
    ]


@relax.transform.function_pass(opt_level=0, name="tvmbridge.ExternalizeDropout")
class ExternalizeDropout:
    """Every training dropout of every function becomes a multiply by a mask parameter."""

    def transform_function(
        self, func: relax.Function, mod: tvm.IRModule, ctx: tvm.transform.PassContext
    ) -> relax.Function:
        return externalize_dropout(func)
