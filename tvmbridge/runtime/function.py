"""The compiled halves as a ``torch.autograd.Function``.

Tensors cross between PyTorch and TVM by DLPack in both directions, without copies: TVM reads
PyTorch's inputs and state in place, and PyTorch receives TVM's outputs, captured values and
gradients as tensors over TVM's memory. The only copy is for a non-contiguous input (TVM kernels
assume compact row-major data); unaligned views are accepted as they are.

Autograd's own rules hold: what the backward reads is saved with ``save_for_backward`` (a captured
value that *is* an output is saved as that output), so an in-place edit of it raises PyTorch's
"modified by an inplace operation" error instead of giving wrong gradients; outputs without a
gradient are marked non-differentiable. A backward asked for with ``create_graph=True`` cannot
be differentiated through TVM's code, so it differentiates PyTorch's own forward instead, rerun on
the same inputs with the random generator as it was at the call (as ``torch.utils.checkpoint``
does): higher-order gradients are PyTorch's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import tvm_ffi

from .. import names
from ..pipeline import CompiledModule


def to_tvm(t: torch.Tensor) -> Any:
    t = t.detach()
    if t.numel() == 0:  # torch calls any strides of an empty tensor contiguous; TVM wants compact ones
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    elif not t.is_contiguous():
        t = t.contiguous()
    return tvm_ffi.from_dlpack(t, require_alignment=0)


def to_torch(a: Any) -> torch.Tensor:
    return torch.from_dlpack(a)


@dataclass
class Call:
    """One dispatched call: the compiled module, the call's random values, and what a double
    backward needs to rerun PyTorch's forward (``eager``, the generator states at the call)."""

    compiled: CompiledModule
    randoms: list[torch.Tensor]
    eager: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    rng_states: dict[str, torch.Tensor] | None = None


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (compact) tensors share memory: TVM may hand out one buffer as two values."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class TVMFunction(torch.autograd.Function):
    """``apply(call, *tensors)`` with ``tensors`` = the call's tensors, then the module's state."""

    @staticmethod
    def forward(ctx: Any, call: Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        compiled = call.compiled
        primal = list(tensors) + call.randoms
        with compiled.vm() as vm:
            result = [to_torch(r) for r in vm[names.FORWARD](*[to_tvm(t) for t in primal])]
        n = compiled.num_outputs
        outputs, captured = result[:n], result[n:]
        # an output over an input's memory (the input returned as is) is copied: edits of it must not
        # reach the input; an output over a captured value's memory is saved too, so that an
        # in-place edit of it fails the version check in backward, as in PyTorch
        outputs = [o.clone() if any(_overlaps(o, t) for t in tensors) else o for o in outputs]
        guarded = [o for o in outputs if any(_overlaps(o, c) for c in captured)]
        read = [primal[i] for i in compiled.split.backward_param_indices]
        ctx.save_for_backward(*captured, *read, *guarded)
        ctx.num_saved = len(captured) + len(read)
        ctx.call = call
        ctx.inputs = list(tensors)
        ctx.versions = [t._version for t in tensors]
        ctx.output_meta = [(o.shape, o.dtype) for o in outputs]  # this call's sizes (a variant may be symbolic)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, compiled.differentiable) if not d])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: differentiate PyTorch's forward instead
            return (None, *_eager_vjp(ctx, grad_outputs))
        compiled: CompiledModule = ctx.call.compiled
        grads_in = []
        for g, (shape, dtype), d in zip(grad_outputs, ctx.output_meta, compiled.differentiable):
            if d:
                grads_in.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=compiled.device))
        saved = ctx.saved_tensors[: ctx.num_saved]  # unpacking all of them checks their versions
        args = [to_tvm(t) for t in saved] + [to_tvm(g) for g in grads_in]
        with compiled.vm() as vm:
            grads = vm[names.BACKWARD](*args)
        result: list[torch.Tensor | None] = [None] * len(ctx.inputs)
        needs = ctx.needs_input_grad[1:]
        for g, i in zip(grads, compiled.grad_param_indices):
            if i < len(result) and needs[i]:
                result[i] = to_torch(g)
        return (None, *result)


def _eager_vjp(ctx: Any, grad_outputs: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
    """The vector-Jacobian product through PyTorch's own forward, differentiable itself."""
    for t, v in zip(ctx.inputs, ctx.versions):
        if t._version != v:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a {tuple(t.shape)} input of a TVM-dispatched module is at version {t._version}; "
                f"expected version {v} instead."
            )
    call: Call = ctx.call
    devices = [call.compiled.device] if call.compiled.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        if call.rng_states is not None:
            torch.set_rng_state(call.rng_states["cpu"])
            if "cuda" in call.rng_states:
                torch.cuda.set_rng_state(call.rng_states["cuda"], call.compiled.device)
        outputs = call.eager(ctx.inputs)
    pairs = [(o, g) for o, g, d in zip(outputs, grad_outputs, call.compiled.differentiable) if d and g is not None]
    wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
    grads = torch.autograd.grad([o for o, _ in pairs], [ctx.inputs[i] for i in wanted],
                                [g for _, g in pairs], create_graph=True, allow_unused=True)
    result: list[torch.Tensor | None] = [None] * len(ctx.inputs)
    for i, g in zip(wanted, grads):
        result[i] = g
    return result


def infer(compiled: CompiledModule, primal: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Outputs only, through ``forward_infer`` (nothing captured)."""
    with compiled.vm() as vm:
        result = vm[names.FORWARD_INFER](*[to_tvm(t) for t in primal])
    return tuple(to_torch(r) for r in result)
