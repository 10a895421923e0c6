"""Peak memory measured at PyTorch's CPU allocator, to check the simulator against reality.

`measure_fx_peak` (in ``simulate``) counts the storages an FX graph keeps referenced, so it
agrees with the simulator by construction. Here the program runs eagerly under
``torch.profiler`` with ``profile_memory=True``: the CPU allocator reports every allocation and
free (pointer, bytes) with the op that made it, including kernels' internal buffers and the
temporaries of autograd's C++ backward formulas that no graph node shows. Frees are matched to
allocations by pointer, so memory allocated before the call never counts as freed. Needs no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from analysis.memory.importer import ModelInputs, training_step
from analysis.tensors import storage_key, tensor_leaves


@dataclass
class AllocatorPeak:
    """`peak` = `baseline` (bytes the arguments hold) + the highest running total of the bytes
    allocated and not yet freed during the call; `peak_op` ran at that moment."""

    peak: int
    baseline: int
    peak_op: str
    allocations: int


def held_bytes(value: Any) -> int:
    """Bytes of the distinct storages among the tensors in `value` (views counted once)."""
    sizes = {storage_key(t): t.untyped_storage().nbytes() for t in tensor_leaves(value)}
    return sum(sizes.values())


def _events(prof: profile) -> list[Any]:
    """Allocation events of a finished profile in time order (frees have negative sizes)."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None  # a finished profile
    out: list[Any] = []
    todo: list[Any] = list(prof.profiler.kineto_results.experimental_event_tree())  # read by tag, below
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            out.append(e)
        todo.extend(e.children)
    return sorted(out, key=lambda e: e.start_time_ns)


def _op_name(event: Any) -> str:
    p = event.parent
    return p.name if p is not None else "(no op)"


def allocator_peak(fn: Callable[..., Any], *args: Any, baseline: int | None = None) -> AllocatorPeak:
    """Run ``fn(*args)`` once under the profiler; see `AllocatorPeak`. `baseline` defaults to
    the bytes the arguments hold (the caller keeps them for the whole call)."""
    base = held_bytes(list(args)) if baseline is None else baseline
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    live: dict[int, int] = {}
    cur = top = 0
    top_op = "(none)"
    events = _events(prof)
    for e in events:
        size, ptr = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0:
            live[ptr] = size
            cur += size
        elif ptr in live:
            cur -= live.pop(ptr)
        if cur > top:
            top, top_op = cur, _op_name(e)
    return AllocatorPeak(base + top, base, top_op, sum(e.extra_fields.alloc_size > 0 for e in events))


def measure_training_step(model: torch.nn.Module, inputs: ModelInputs, **kwargs: Any) -> AllocatorPeak:
    """The allocator's peak of one eager run of the training step that `import_training_step`
    traces (same function, same arguments: parameters, optimizer state, buffers, inputs).
    ``kwargs`` as for `training_step` (target, loss_fn, optimizer)."""
    prog = training_step(model, inputs, **kwargs)  # fresh copies of parameters and state
    return allocator_peak(prog.fn, *prog.args)
