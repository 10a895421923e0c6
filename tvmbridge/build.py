"""Stage 6: build a Relax function for the module's device and load it in a VM.

Target from the torch device: ``llvm`` (with the host's CPU features and core count) on CPU,
``cuda`` for CUDA tensors, ``rocm`` for ROCm (HIP) tensors. The default ``tvm.compile`` pipeline
legalizes but does not fuse; the bridge adds operator fusion so that elementwise chains become one
kernel, and on GPU applies dlight's default schedules (untuned GPU kernels are not even valid).
"""
from __future__ import annotations

import os

import torch
import tvm
from tvm import relax

from .errors import ConversionError


def target_for(device: torch.device) -> tvm.target.Target:
    """The TVM target for a torch device."""
    if device.type == "cpu":
        cores = int(os.environ.get("TVMBRIDGE_NUM_CORES", os.cpu_count() or 1))
        return tvm.target.Target({"kind": "llvm", "mcpu": _host_cpu(), "num-cores": cores})
    if device.type == "cuda":
        if torch.version.hip:
            return tvm.target.Target({"kind": "rocm"})
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            return tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"})
        return tvm.target.Target({"kind": "cuda", "arch": "sm_80"})  # compile-only (no GPU here)
    raise ConversionError("build", f"no TVM target for device {device}; supported: cpu, cuda, rocm")


def _host_cpu() -> str:
    try:
        return str(tvm.target.codegen.llvm_get_system_cpu())
    except Exception:  # noqa: BLE001 - older/newer builds name it differently
        return "generic"


def tvm_device(device: torch.device) -> tvm.runtime.Device:
    if device.type == "cpu":
        return tvm.cpu(0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tvm.rocm(index) if torch.version.hip else tvm.cuda(index)


def lower(
    mod: tvm.IRModule, target: tvm.target.Target, schedule: bool = True, fuse: bool = True
) -> tvm.IRModule:
    """The bridge's Relax pipeline up to (not including) code generation. ``schedule=False``
    leaves TVM's own CPU kernels unscheduled (serial loops), ``fuse=False`` keeps one kernel per
    Relax op: both for measuring what each buys."""
    seq = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant()]
    if fuse:
        seq += [relax.transform.FuseOps(), relax.transform.FuseTIR()]
    seq.append(relax.transform.DeadCodeElimination())
    with target:
        mod = tvm.ir.transform.Sequential(seq)(mod)
        if target.kind.name == "llvm" and schedule:
            from .cpu_schedule import apply_cpu_schedules

            mod = apply_cpu_schedules(mod, target)
        if target.kind.name in ("cuda", "rocm"):
            from tvm.s_tir import dlight

            mod = dlight.ApplyDefaultSchedule(
                dlight.gpu.Matmul(), dlight.gpu.Reduction(),
                dlight.gpu.GeneralReduction(), dlight.gpu.Fallback(),
            )(mod)
    return mod


def compile_module(
    mod: tvm.IRModule, target: tvm.target.Target, schedule: bool = True, fuse: bool = True
) -> tvm.runtime.Executable:
    try:
        lowered = lower(mod, target, schedule, fuse)
        return tvm.compile(lowered, target=target)
    except Exception as exc:  # noqa: BLE001
        raise ConversionError("build", f"compiling for {target.kind.name} failed: {type(exc).__name__}: {exc}") from exc


def load(executable: tvm.runtime.Executable, device: torch.device) -> relax.VirtualMachine:
    return relax.VirtualMachine(executable, tvm_device(device))
