"""Every scheduled CPU kernel of a compile against its own unscheduled form, on random inputs.

The bridge's CPU schedules (``backend/cpu_schedules.py``) inline, fuse, split, vectorize and
parallelize TVM's kernels; a schedule must never change what a kernel computes. This builds each
kernel twice (TVM's serial loops, and the schedule ``apply_cpu_schedules`` gives it), runs both
on the same random inputs and reports the largest difference. Kernels with symbolic sizes are
left out (no sizes to draw inputs at).

    from tvmbridge.tools.kernel_check import check_kernels
    diffs = check_kernels(dispatched_module._tvm_dispatch.compiled)
    assert all(d.ok for d in diffs)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import tvm

from ..backend.build import lower
from ..backend.cpu_schedules import default_cpu_schedule
from ..devices import target_for

if TYPE_CHECKING:
    from ..runtime.compiled import CompiledModule


@dataclass(frozen=True)
class KernelDiff:
    """One kernel: the largest absolute difference of any output, against the largest value."""

    name: str
    max_abs_diff: float
    max_abs_value: float

    @property
    def ok(self) -> bool:  # reassociated float32 sums differ in their last bits only
        return self.max_abs_diff <= 1e-5 * max(1.0, self.max_abs_value)


def _static_shape(buf: tvm.tirx.Buffer) -> list[int] | None:
    try:
        return [int(s) for s in buf.shape]
    except (TypeError, ValueError):
        return None


def _run(func: tvm.tirx.PrimFunc, target: tvm.target.Target, args: list[np.ndarray]) -> list[np.ndarray]:
    built = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]
    tensors = [tvm.runtime.tensor(a.copy()) for a in args]
    built(*tensors)
    return [t.numpy() for t in tensors]


def check_kernels(compiled: CompiledModule, seed: int = 0) -> list[KernelDiff]:
    """Each scheduled static-shape kernel of ``compiled`` (a ``CompiledModule`` for CPU) against
    its unscheduled form."""
    target = target_for(torch.device("cpu"))
    mod = lower(compiled.stages["fast_math"], target, schedule=False, fuse=compiled.options.fuse)
    rng = np.random.default_rng(seed)
    diffs = []
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        shapes = [_static_shape(p.ty) for p in func.params]
        sch = default_cpu_schedule(func, target) if all(s is not None for s in shapes) else None
        if sch is None:
            continue
        args = []
        for p, shape in zip(func.params, shapes):
            dtype = str(p.ty.dtype)
            args.append(
                rng.standard_normal(shape).astype(dtype)
                if "float" in dtype
                else rng.integers(0, 2, shape).astype(dtype)
            )
        want, got = _run(func, target, args), _run(sch.mod["main"], target, args)
        diff = max(
            (float(np.abs(g.astype(np.float64) - w.astype(np.float64)).max()) for g, w in zip(got, want) if w.size),
            default=0.0,
        )
        top = max((float(np.abs(w.astype(np.float64)).max()) for w in want if w.size), default=0.0)
        diffs.append(KernelDiff(gv.name_hint, diff, top))
    return diffs
