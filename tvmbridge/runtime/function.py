"""The compiled halves as a ``torch.autograd.Function``.

Tensors cross between PyTorch and TVM by DLPack in both directions, without copies: TVM reads
PyTorch's inputs and parameters in place, and PyTorch receives TVM's outputs, captured values and
gradients as tensors over TVM's memory. The only copy is for a non-contiguous input (TVM kernels
assume compact row-major data); unaligned views are accepted as they are.
"""
from __future__ import annotations

from typing import Any

import torch
import tvm_ffi

from .. import names
from ..pipeline import CompiledModule


def to_tvm(t: torch.Tensor) -> Any:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return tvm_ffi.from_dlpack(t, require_alignment=0)


def to_torch(a: Any) -> torch.Tensor:
    return torch.from_dlpack(a)


class TVMFunction(torch.autograd.Function):
    """``apply(compiled, masks, *tensors)`` with ``tensors`` = user inputs then parameters."""

    @staticmethod
    def forward(ctx: Any, compiled: CompiledModule, masks: list[torch.Tensor], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        primal = list(tensors) + list(masks)
        result = compiled.vm[names.FORWARD](*[to_tvm(t) for t in primal])
        result = [to_torch(r) for r in result]
        n = compiled.num_outputs
        outputs, captured = result[:n], result[n:]
        ctx.compiled = compiled
        ctx.num_tensors = len(tensors)
        ctx.save_for_backward(*captured, *[primal[i] for i in compiled.split.backward_param_indices])
        ctx.num_captured = len(captured)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        compiled: CompiledModule = ctx.compiled
        saved = ctx.saved_tensors
        grads_in = []
        for g, (shape, dtype) in zip(grad_outputs, compiled.output_meta):
            if g is None:  # an output that did not reach the loss
                g = torch.zeros(shape, dtype=dtype, device=compiled.device)
            grads_in.append(g)
        args = [to_tvm(t) for t in saved] + [to_tvm(g) for g in grads_in]
        grads = compiled.vm[names.BACKWARD](*args)
        result: list[torch.Tensor | None] = [None] * ctx.num_tensors
        needs = ctx.needs_input_grad[2:]
        for g, i in zip(grads, compiled.grad_param_indices):
            if i < ctx.num_tensors and needs[i]:
                result[i] = to_torch(g)
        return (None, None, *result)


def infer(compiled: CompiledModule, primal: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Outputs only, through ``forward_infer`` (nothing captured)."""
    result = compiled.vm[names.FORWARD_INFER](*[to_tvm(t) for t in primal])
    return tuple(to_torch(r) for r in result)
