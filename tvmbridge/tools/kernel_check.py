"""Every scheduled kernel of a compile against its own unscheduled form, on random inputs.

The bridge's CPU schedules (``backend/cpu_schedules.py``) and dlight's GPU rules
(``backend/gpu_schedules.py``) inline, fuse, split, vectorize, bind threads and reduce across
threads; a schedule must never change what a kernel computes. This builds each kernel twice
(TVM's serial loops on the CPU, and the schedule the build gives it, on the compile's device),
runs both on the same random inputs and reports the largest difference. Kernels with symbolic
sizes are left out (no sizes to draw inputs at), and on a GPU those TOPI wrote for the GPU
directly (already scheduled when legalized: no serial form to compare with).

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
from ..backend.codegen import tir_pipeline
from ..backend.cpu_schedules import cpu_rules
from ..backend.gpu_schedules import gpu_schedule_rules
from ..devices import target_for, tvm_device
from ..ir import first_schedule

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


def _run_all(
    funcs: dict[str, tvm.tirx.PrimFunc], target: tvm.target.Target, args: dict[str, list], device: torch.device
) -> dict:
    """Every kernel built in one module (one code generation, one nvcc call on a GPU) and run on
    its own copy of its inputs; each kernel's buffers after the call."""
    mod = tvm.IRModule({name: f.without_attr("target").with_attr("global_symbol", name) for name, f in funcs.items()})
    built = tvm.compile(mod, target=target, tir_pipeline=tir_pipeline(target))  # as the bridge builds them
    dev = tvm_device(device)
    out = {}
    for name in funcs:
        tensors = [tvm.runtime.tensor(a.copy(), device=dev) for a in args[name]]
        built[name](*tensors)
        out[name] = [t.numpy() for t in tensors]
    return out


def _difference(got: np.ndarray, want: np.ndarray) -> float:
    """The largest absolute difference where ``want`` is finite; inf where the non-finite
    values (NaN, +-inf) are not the same ones at the same places."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    if not np.array_equal(finite, np.isfinite(g)) or not np.array_equal(g[~finite], w[~finite], equal_nan=True):
        return float("inf")
    return float(np.abs(g[finite] - w[finite]).max()) if finite.any() else 0.0


def _binds_threads(func: tvm.tirx.PrimFunc) -> bool:
    """Whether ``func`` is already a GPU kernel (TOPI's own GPU forms): no serial form to run."""
    if func.attrs and "tirx.is_scheduled" in func.attrs:
        return True
    text = func.script()  # TIR has no Python visitor in TVM 0.27
    return "T.launch_thread(" in text or "T.thread_binding(" in text


def check_kernels(compiled: CompiledModule, seed: int = 0) -> list[KernelDiff]:
    """Each scheduled static-shape kernel of ``compiled`` against its unscheduled form (on the
    CPU); the scheduled one runs on the compile's device (a CPU or a CUDA GPU)."""
    device = compiled.device if compiled.device is not None else torch.device("cpu")
    contract = compiled.options.fp_contract  # the target the compile built for
    target, cpu = target_for(device, contract), target_for(torch.device("cpu"), contract)
    mod = lower(compiled.stages["fast_math"], target, schedule=False, fuse=compiled.options.fuse)
    rng = np.random.default_rng(seed)
    serial, scheduled, args = {}, {}, {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc) or _binds_threads(func):
            continue
        shapes = [_static_shape(p.ty) for p in func.params]
        if any(s is None for s in shapes):
            continue
        rules = cpu_rules() if device.type == "cpu" else gpu_schedule_rules()
        sch = first_schedule(rules, func, target)
        if sch is None:
            continue
        name = gv.name_hint
        serial[name], scheduled[name] = func, sch.mod["main"]
        args[name] = [
            rng.standard_normal(shape).astype(str(p.ty.dtype))
            if "float" in str(p.ty.dtype)
            else rng.integers(0, 2, shape).astype(str(p.ty.dtype))
            for p, shape in zip(func.params, shapes)
        ]
    if not serial:
        return []
    wants, gots = _run_all(serial, cpu, args, torch.device("cpu")), _run_all(scheduled, target, args, device)
    diffs = []
    for name in serial:
        want, got = wants[name], gots[name]
        diff = max((_difference(g, w) for g, w in zip(got, want) if w.size), default=0.0)
        top = max((float(np.abs(w[np.isfinite(w)]).max(initial=0.0)) for w in want if w.size), default=0.0)
        diffs.append(KernelDiff(name, diff, top))
    return diffs
