"""Torch devices and dtypes as TVM sees them: the compile target, the runtime device, dtype names.

``llvm`` (with the host's CPU features and core count) on CPU, ``cuda`` for CUDA tensors, ``rocm``
for ROCm (HIP) tensors. :func:`prepare_cpu_runtime` sets TVM's thread-pool policy before the first
TVM kernel runs in this process (the pool reads it once, when it starts). :func:`on_torch_stream`
puts TVM's GPU kernels on PyTorch's current stream.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import tvm
import tvm_ffi

from .errors import ConversionError

SUPPORTED = ("cpu", "cuda")  # torch device types; ROCm tensors are "cuda" devices in torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def torch_dtype(tvm_dtype: str) -> torch.dtype:
    """The torch dtype of a TVM dtype name (``"float32"`` -> ``torch.float32``)."""
    return TORCH_DTYPES[str(tvm_dtype)]


def target_for(device: torch.device, fp_contract: bool = False) -> tvm.target.Target:
    """The TVM target for a torch device. On a CPU without ``fp_contract``, without the FMA
    feature: TVM's LLVM code generator lets LLVM fuse any multiply feeding an add into one FMA
    (``AllowFPOpFusion`` is fixed to ``Fast``, no target option turns it off), so a fused kernel
    rounds ``a * b + c`` once where eager's two ops round twice; without the feature there is
    no instruction to fuse into. (On AVX-512 CPUs that also leaves TVM's own kernels at AVX2's
    width: AVX-512 implies FMA.) Its ``num-cores`` is :func:`cpu_threads`: the CPU schedules
    make no loop parallel where that is one."""
    if device.type == "cpu":
        spec: dict = {"kind": "llvm", "mcpu": host_cpu(), "num-cores": cpu_threads()}
        if not fp_contract:
            spec["mattr"] = ["-fma"]
        return tvm.target.Target(spec)
    if device.type == "cuda":
        if torch.version.hip:
            return tvm.target.Target({"kind": "rocm"})
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            return tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"})
        return tvm.target.Target({"kind": "cuda", "arch": "sm_80"})  # compile-only (no GPU here)
    raise ConversionError("build", f"no TVM target for device {device}; supported: cpu, cuda, rocm")


@functools.cache
def host_cpu() -> str:
    """LLVM's name for this CPU (``znver4``, ``sapphirerapids``, ...), or ``generic``."""
    try:
        return str(tvm.target.codegen.llvm_get_system_cpu())
    except Exception:  # noqa: BLE001 - older/newer builds name it differently
        return "generic"


def tvm_device(device: torch.device) -> tvm.runtime.Device:
    if device.type == "cpu":
        return tvm.cpu(0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tvm.rocm(index) if torch.version.hip else tvm.cuda(index)


def on_torch_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """TVM's kernels (inside: a VM call) on PyTorch's current stream of ``device``, as a PyTorch op
    would run. TVM launches on the stream its FFI environment names, the legacy default stream
    unless set; PyTorch's streams (``torch.cuda.stream(s)``, autograd's backward on the forward's
    stream) do not wait for it, so a result read there could be read before TVM wrote it."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return tvm_ffi.use_raw_stream(tvm_device(device), torch.cuda.current_stream(device).cuda_stream)


def rounds_every_op(target: tvm.target.Target) -> bool:
    """Whether ``target``'s kernels round every multiply and add apart, as eager's separate ops do:
    a CPU target without the FMA feature (:func:`target_for` without ``fp_contract``)."""
    return target.kind.name == "llvm" and "-fma" in [str(a) for a in target.attrs.get("mattr", [])]


def cpu_threads() -> int:
    """The threads a parallel loop of a TVM CPU kernel runs on in this process:
    ``TVMBRIDGE_NUM_CORES``, else PyTorch's (``torch.get_num_threads()``) where the loops run on
    PyTorch's OpenMP threads (``parallel_launch``), else the size of TVM's thread pool
    (``TVM_NUM_THREADS``, else half the logical CPUs on x86: one on a 2-vCPU machine, where a
    parallel loop only adds its launch, some 6 us, to every call of a kernel)."""
    value = os.environ.get("TVMBRIDGE_NUM_CORES", "").strip()
    if value:
        return max(1, int(value))
    from .parallel_launch import launcher

    if launcher() is not None:
        return max(1, torch.get_num_threads())
    prepare_cpu_runtime()  # the pool reads its settings when it starts
    return max(1, int(tvm.get_global_func("runtime.NumThreads")()))


@functools.cache
def prepare_cpu_runtime() -> None:
    """TVM's CPU workers must not spin after a parallel kernel: the offloaded GEMMs run on
    PyTorch's own threads in between, and spinning TVM workers steal their cores. Nor may TVM's
    pool pin threads to cores: starting, it binds the thread that starts it (the user's main
    thread, where its pool has one thread) to one core, and every thread or process started from
    it later inherits that (PyTorch's OpenMP workers, a DataLoader's, the compile's own threads):
    the process ran on one core of two after its first compiled call. A user's own
    ``TVM_THREAD_POOL_SPIN_COUNT`` and ``TVM_BIND_THREADS`` are respected. The pool's size is left
    to TVM (``TVM_NUM_THREADS``, else half the logical CPUs on x86); the README gives the
    measurements."""
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
    os.environ.setdefault("TVM_BIND_THREADS", "0")
