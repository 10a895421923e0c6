"""Dropout externalization: ``R.nn.dropout(x, p)`` becomes ``x * mask`` with ``mask`` a new
function input.

The mask is drawn by PyTorch, in graph order, exactly as PyTorch's own dropout draws it on that
device (see :func:`draw_masks`), and already holds the ``1/(1-p)`` scale, as PyTorch's does: the
product ``x * mask`` is then the very floating point operation PyTorch performs, so outputs and
gradients match PyTorch bit for bit in the dropout itself under the same seed. Masks are inputs,
not captured values: the backward reads them like any other input and recomputation stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from tvm import relax
from tvm.ir import Op

from .. import rng
from ._util import only_dataflow_block, rebuild

_DROPOUT = Op.get("relax.nn.dropout")


@dataclass(frozen=True)
class DropoutSite:
    """One training dropout: the mask input's shape, dtype and drop probability."""

    shape: tuple[int, ...]
    dtype: str
    p: float


def externalize_dropout(func: relax.Function) -> tuple[relax.Function, list[DropoutSite]]:
    """Replace every ``R.nn.dropout`` with a multiply by a new trailing parameter
    ``dropout_mask{i}``; returns the new function and the sites in parameter order."""
    block = only_dataflow_block(func, "passes")
    sites: list[DropoutSite] = []
    masks: list[relax.Var] = []
    bindings: list[relax.Binding] = []
    for b in block.bindings:
        value = b.value
        if isinstance(value, relax.Call) and value.op.same_as(_DROPOUT):
            x = value.args[0]
            ty = x.ty
            shape = tuple(int(s) for s in ty.shape)
            dtype = str(ty.dtype)
            mask = relax.Var(f"dropout_mask{len(masks)}", relax.TensorType(shape, dtype))
            masks.append(mask)
            sites.append(DropoutSite(shape, dtype, float(value.attrs.rate)))
            out = relax.DataflowVar(f"{b.var.name}_dropped", relax.TensorType(shape, dtype))
            bindings.append(relax.VarBinding(out, relax.op.multiply(x, mask)))
            bindings.append(relax.VarBinding(b.var, relax.Tuple([out, mask])))
        else:
            bindings.append(b)
    if not masks:
        return func, []
    num_input = func.attrs["num_input"] if func.attrs and "num_input" in func.attrs else None
    new = rebuild(func, list(func.params) + masks, bindings, func.body.body)
    if num_input is not None:
        new = new.with_attr("num_input", num_input)
    return new, sites


def draw_masks(sites: list[DropoutSite], device: torch.device, dtype_map: dict[str, torch.dtype]) -> list[torch.Tensor]:
    """Draw the scaled masks with PyTorch's RNG, in graph order, the way ``F.dropout`` does.

    On CPU ``at::dropout`` runs ``noise = empty_like(x).bernoulli_(1-p); noise.div_(1-p)``; on
    CUDA/ROCm it runs the fused ``native_dropout`` kernel, whose mask we get by applying it to
    ones. Either way the generator advances exactly as in the eager module. On CPU the float32
    ``bernoulli_`` is :func:`tvmbridge.rng.bernoulli_`, the same stream drawn by a vectorized
    kernel (8x faster at (8,12,128,128)), where its start-up check passed and the mask is large
    enough to repay the kernel's fixed cost.
    """
    out = []
    fast = device.type == "cpu" and rng.available()
    for s in sites:
        dt = dtype_map[s.dtype]
        if device.type == "cpu":
            noise = torch.empty(s.shape, dtype=dt, device=device)
            if fast and dt == torch.float32 and noise.numel() >= rng.MIN_ELEMENTS:
                rng.bernoulli_(noise, 1 - s.p)
            else:
                noise.bernoulli_(1 - s.p)
            noise.div_(1 - s.p)
        else:
            noise = torch.native_dropout(torch.ones(s.shape, dtype=dt, device=device), s.p, True)[0]
        out.append(noise)
    return out
