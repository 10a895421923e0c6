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

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import tvm_ffi

from .. import names
from ..devices import on_torch_stream
from ..errors import describe
from ..pipeline.parts import PART_OF
from .compiled import CompiledModule
from .verify import GradientCheck, first_slots, own_inputs


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
    sizes: dict[str, int] = field(default_factory=dict)  # the call's shape symbols (a symbolic variant)
    check: GradientCheck | None = None  # a variant's first calls: PyTorch's graph to compare gradients with
    discard: Callable[[str], Any] | None = None  # drops the variant (its backward failed or disagreed)


_Result = TypeVar("_Result", torch.Tensor, torch.Tensor | None)  # forward outputs; gradients (None: none)


def overlapping(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor of ``tensors`` (compact): whether it shares memory with one of ``others`` (TVM
    may hand out one buffer as two values). The others' address ranges sorted and merged once, then
    a binary search per tensor: a CNN's forward returns hundreds of updated buffers beside hundreds
    of captured values, and a test of every pair cost more than its compiled forward."""
    ranges: dict[torch.device, list[tuple[int, int]]] = {}
    for c in others:
        if c.numel():
            ranges.setdefault(c.device, []).append((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()))
    merged: dict[torch.device, tuple[list[int], list[int]]] = {}
    for device, spans in ranges.items():
        starts: list[int] = []
        stops: list[int] = []
        for start, stop in sorted(spans):
            if stops and start < stops[-1]:
                stops[-1] = max(stops[-1], stop)
            else:
                starts.append(start)
                stops.append(stop)
        merged[device] = (starts, stops)
    out = []
    for t in tensors:
        found = merged.get(t.device) if t.numel() else None
        if found is None:
            out.append(False)
            continue
        start = t.data_ptr()
        # the last range starting before t ends: the only one that can reach t (they are disjoint)
        k = bisect.bisect_left(found[0], start + t.numel() * t.element_size()) - 1
        out.append(k >= 0 and found[1][k] > start)
    return out


def unalias(results: list[_Result], owned: Sequence[torch.Tensor | None] = ()) -> list[_Result]:
    """``results`` with every tensor that shares memory with an earlier one, or with one of
    ``owned`` (the caller's inputs, the incoming gradients, saved values: their whole storages),
    replaced by a copy.

    TVM hands one buffer out as several values where its graph computes one value twice (two
    parallel Linears' equal gradients, ``h + 0`` and ``h * 1``, a gradient that *is* the output
    gradient). PyTorch's results never share memory that way: an in-place edit of one (gradient
    accumulation, clipping, ``optimizer.step``) would change the others. A sweep over address
    ranges, so hundreds of gradients cost a sort."""
    # (device index, start, is_result, stop, index): owned storages whole, results as they are; on
    # every call over every gradient and saved value, so the cheapest of torch's accessors
    # (an owned storage starts at or before any result inside it, so the sweep meets it first)
    spans = []
    for t in owned:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            start = storage.data_ptr()
            spans.append((t.get_device(), start, 0, start + storage.nbytes(), -1))
    for i, t in enumerate(results):
        if t is not None and (size := t.nbytes):
            start = t.data_ptr()
            spans.append((t.get_device(), start, 1, start + size, i))
    out = list(results)
    device, end = None, -1
    for dev, start, is_result, stop, i in sorted(spans):  # at one address, owned (0) sorts first
        if dev != device:
            device, end = dev, -1
        if is_result and start < end:
            result = results[i]
            assert result is not None  # a result's span: a tensor
            out[i] = result.clone()
        else:
            end = max(end, stop)
    return out


def differentiable(compiled: CompiledModule, tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per output: a float user output with a gradient path from a tensor of this call that
    requires grad (the others come back without ``requires_grad``, as from PyTorch)."""
    sources = compiled.traced.grad_sources
    return [
        d and (i >= len(sources) or any(tensors[j].requires_grad for j in sources[i]))
        for i, d in enumerate(compiled.differentiable)
    ]


class CompiledCallError(RuntimeError):
    """The compiled code itself failed (TVM's VM or a kernel), as opposed to PyTorch around it."""


def run_vm(compiled: CompiledModule, function: str, args: list[Any]) -> list[Any]:
    """``function`` of the compiled module on ``args``; any failure inside is a ``CompiledCallError``."""
    try:
        with compiled.vm(PART_OF[function]) as vm, on_torch_stream(compiled.device):
            return list(vm[function](*args))
    except Exception as exc:  # noqa: BLE001 - TVM raises many types
        raise CompiledCallError(describe(exc)) from exc


class TVMFunction(torch.autograd.Function):
    """``apply(call, *tensors)`` with ``tensors`` = the call's tensors, then the module's state."""

    @staticmethod
    def forward(ctx: Any, call: Call, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        compiled = call.compiled
        primal = list(tensors) + call.randoms
        result = [to_torch(r) for r in run_vm(compiled, names.FORWARD, [to_tvm(t) for t in primal])]
        n = compiled.num_outputs
        outputs, captured = result[:n], result[n:]
        # an output over an input's memory (the input returned as is) is copied: edits of it must not
        # reach the input; an output over a captured value's memory is saved too, so that an
        # in-place edit of it fails the version check in backward, as in PyTorch, unless PyTorch's
        # output is a copy of that value (``h.clone()``): then it is copied, apart as PyTorch's is
        outputs = unalias(outputs, tensors)
        shared = overlapping(outputs, captured)
        copies = compiled.traced.copied_outputs
        outputs = [o.clone() if s and i in copies else o for i, (o, s) in enumerate(zip(outputs, shared))]
        guarded = [o for i, (o, s) in enumerate(zip(outputs, shared)) if s and i not in copies]
        copied = compiled.read_as_copies
        read = [primal[i].clone() if i in copied else primal[i] for i in compiled.split.backward_param_indices]
        ctx.save_for_backward(*captured, *read, *guarded)
        ctx.num_saved = len(captured) + len(read)
        ctx.call = call
        ctx.inputs = list(tensors)
        ctx.versions = [t._version for t in tensors]
        ctx.output_meta = [(o.shape, o.dtype) for o in outputs]  # this call's sizes (a variant may be symbolic)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, differentiable(compiled, tensors)) if not d])
        return tuple(outputs)

    @staticmethod
    @torch.compiler.disable  # autograd calls it from a frame dynamo may be compiling (a compiled train step)
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: differentiate PyTorch's forward instead
            return (None, *_eager_vjp(ctx, grad_outputs))
        compiled: CompiledModule = ctx.call.compiled
        grads_in = []
        for g, (shape, dtype), d in zip(grad_outputs, ctx.output_meta, compiled.differentiable):
            if d:
                grads_in.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=compiled.device))
        saved = ctx.saved_tensors[: ctx.num_saved]  # unpacking all of them checks their versions
        args = [to_tvm(t) for t in saved] + [to_tvm(g) for g in grads_in]
        call: Call = ctx.call
        if compiled.split.size_symbols:
            args.append(tvm_ffi.Shape(tuple(call.sizes[name] for name in compiled.split.size_symbols)))
        try:
            grads = run_vm(compiled, names.BACKWARD, args)
        except CompiledCallError as exc:  # the step goes on: PyTorch's forward, differentiated
            if call.discard is not None:
                call.discard(f"its backward failed ({exc})")
            return (None, *_eager_vjp(ctx, grad_outputs))
        result: list[torch.Tensor | None] = [None] * len(ctx.inputs)
        needs = ctx.needs_input_grad[1:]
        for g, i in zip(grads, compiled.grad_param_indices):
            if i < len(result) and needs[i]:
                result[i] = to_torch(g)
        # autograd may keep a gradient as ``.grad`` and add the next into it in place: none may share
        # memory with another, with an incoming gradient or with a value a retained graph still reads
        result = unalias(result, [*grads_in, *saved])
        check, call.check = call.check, None  # once per call; frees PyTorch's graph
        if check is not None:
            want = check.eager_gradients(needs, list(grad_outputs))
            found = check.check(result, want, needs, list(grad_outputs))
            check.on_result(found)
            if found is not None:
                result = want
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
    create_graph = torch.is_grad_enabled()
    devices = [call.compiled.device] if call.compiled.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        if call.rng_states is not None:
            torch.set_rng_state(call.rng_states["cpu"])
            if "cuda" in call.rng_states:
                torch.cuda.set_rng_state(call.rng_states["cuda"], call.compiled.device)
        # the call's own gradients, differentiable through to ctx.inputs
        inputs = own_inputs(ctx.inputs, call.compiled.traced.num_user_inputs)
        outputs = call.eager(inputs)
    pairs = [(o, g) for o, g, d in zip(outputs, grad_outputs, call.compiled.differentiable) if d and g is not None]
    first = first_slots(inputs)  # a tensor passed twice gets its whole gradient once, as in _gradients
    wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need and first[i] == i]
    grads = torch.autograd.grad(
        [o for o, _ in pairs],
        [inputs[i] for i in wanted],
        [g for _, g in pairs],
        create_graph=create_graph,
        allow_unused=True,
    )
    result: list[torch.Tensor | None] = [None] * len(ctx.inputs)
    for i, g in zip(wanted, grads):
        result[i] = g
    return result


def infer(compiled: CompiledModule, primal: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Outputs only, through ``forward_infer`` (nothing captured)."""
    result = run_vm(compiled, names.FORWARD_INFER, [to_tvm(t) for t in primal])
    return tuple(unalias([to_torch(r) for r in result], primal))
