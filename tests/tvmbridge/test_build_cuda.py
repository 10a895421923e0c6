"""The CUDA build path: both halves compile for target ``cuda``, and nvcc compiles the CUDA source
TVM writes (nothing runs here). TVM without a GPU only writes the source; on a GPU machine NVRTC
compiles it at load, where a code generator's slip would first show: nvcc finds it here."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
import torch
import tvm
from tvm import relax

from tvmbridge import compile_training, devices
from tvmbridge.backend import build

from ..helpers import MLP

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


def _modules(mod):
    stack, seen = [mod], []
    while stack:
        m = stack.pop()
        seen.append(m)
        stack.extend(m.imports)
    return seen


def _nvcc_errors(exe: tvm.runtime.Executable, tmp_path) -> list[str]:
    """nvcc's errors on the executable's CUDA source (PTX for sm_80); none where it compiles."""
    (cuda,) = [m for m in _modules(exe.mod) if m.kind == "cuda"]
    src = tmp_path / "kernels.cu"
    src.write_text(cuda.inspect_source())
    run = subprocess.run(["nvcc", "-arch=sm_80", "-ptx", "-o", str(tmp_path / "kernels.ptx"), str(src)],
                         capture_output=True, text=True)
    return [line for line in (run.stdout + run.stderr).splitlines() if "error" in line] or (
        [] if run.returncode == 0 else [f"nvcc exit {run.returncode}"])


def test_forward_and_backward_compile_for_cuda(tmp_path):
    compiled = compile_training(MLP(), (torch.randn(4, 32),))
    target = devices.target_for(torch.device("cuda"))
    assert target.kind.name == "cuda"
    halves = compiled.stages["split"]  # forward, forward_infer and backward, before CPU offload
    assert {gv.name_hint for gv in halves.functions} >= {"forward", "backward"}
    exe = build.compile_module(halves, target)
    cuda = [m for m in _modules(exe.mod) if m.kind == "cuda"]
    assert cuda, "no CUDA device module in the executable"
    src = cuda[0].inspect_source()
    assert "__global__" in src or ".entry" in src
    assert _nvcc_errors(exe, tmp_path) == []


def test_attention_backward_compiles_for_cuda(tmp_path):
    """``scaled_dot_product_attention`` saves a boolean row mask (its safe softmax) that the
    backward's matmul selects on; dlight's Matmul rule vectorizes that select, and TVM wrote it as
    a ``float2`` from a ``ushort2`` that NVRTC rejects (the first call on an H200 failed)."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    compiled = compile_training(Attention(), (torch.randn(2, 8, 16),))
    exe = build.compile_module(compiled.stages["split"], devices.target_for(torch.device("cuda")))
    assert _nvcc_errors(exe, tmp_path) == []


def test_convolutions_and_max_pool_backward_compile_for_cuda(tmp_path):
    """A ResNet stem (strided 7x7 convolution, batch norm, padded 3x3 max pool): dlight's Matmul
    rule asserts on its convolutions' backward and GeneralReduction gives the max pool's backward
    (an argmax) a cross-thread reduction TIR cannot lower; guarded, both leave those kernels to
    the next rule, and the whole training graph builds."""
    from torch import nn

    stem = nn.Sequential(
        nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip
    compiled = compile_training(stem, (torch.randn(2, 3, 32, 32),))
    exe = build.compile_module(compiled.stages["split"], devices.target_for(torch.device("cuda")))
    assert _nvcc_errors(exe, tmp_path) == []


def test_a_rule_that_raises_or_does_not_lower_leaves_the_kernel_to_the_next():
    from tvm.s_tir import dlight

    from tvmbridge.backend.gpu_schedules import Guarded, gpu_schedule_rules
    from tvmbridge.tools.kernel_check import _binds_threads

    class Raises(dlight.ScheduleRule):
        def apply(self, func, target, tunable):
            raise AssertionError("a rule's bug")

    class DoesNotLower(dlight.ScheduleRule):  # GeneralReduction's schedule of Relax's max-pool backward
        def apply(self, func, target, tunable):
            return dlight.gpu.GeneralReduction().apply(func, target, tunable)

    target = devices.target_for(torch.device("cuda"))
    nn = torch.nn
    stem = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Flatten(), nn.Linear(64, 2)
    )
    compiled = compile_training(stem, (torch.randn(2, 3, 8, 8),))
    # Relax's own max-pool backward fused with ReLU's (the bridge's gradient before it had its own):
    # an argmax reduction GeneralReduction schedules across threads with a combiner TIR cannot lower
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4, 8, 8), "float32"))
    g = relax.Var("g", relax.TensorType((2, 4, 4, 4), "float32"))
    with bb.function("main", [x, g]):
        with bb.dataflow():
            dx = relax.op.grad.max_pool2d_backward(g, x, (3, 3), (2, 2), (1, 1, 1, 1))
            out = bb.emit_output(relax.op.where(relax.op.greater(x, relax.const(0.0)), dx, relax.const(0.0)))
        bb.emit_func_output(out)
    for graph, rules in ((compiled.stages["split"], "raises"), (bb.get(), "does not lower")):
        lowered = build.lower(graph, target, schedule=False)
        first, second = Guarded(Raises()), Guarded(DoesNotLower())
        with target:
            scheduled = dlight.ApplyDefaultSchedule(first, second, *gpu_schedule_rules())(lowered.clone())
        funcs = [f for f in scheduled.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
        # every kernel found a rule, but those TOPI wrote for the GPU itself (the max-pool
        # gradient's scatter)
        assert funcs and all(_binds_threads(f) for f in funcs), rules
        assert first.refusals and all("a rule's bug" in why for _, why in first.refusals)
    assert any("No matched reducer" in why for _, why in second.refusals), second.refusals  # the lowering check
    build.compile_module(compiled.stages["split"], target)  # and the whole graph builds


_KERNEL = r"""
extern "C" __global__ void k(float* __restrict__ a, float* __restrict__ b, float* __restrict__ o) {
  int i = threadIdx.x;
  o[i] = a[i] * b[i] + a[i] / b[i] + sqrtf(b[i]);
}
"""


def test_cuda_builds_run_with_exact_math_and_leave_the_environment_as_it_was(monkeypatch):
    from tvmbridge.backend import codegen

    monkeypatch.setenv("TVM_CUDA_NVRTC_EXTRA_OPTS", "-lineinfo")  # a user's own flags are kept
    monkeypatch.delenv("TVM_CUDA_NVCC_NO_FAST_MATH", raising=False)
    seen = {}

    def fake_compile(mod, target, relax_pipeline):
        seen.update({k: os.environ.get(k) for k in ("TVM_CUDA_NVRTC_EXTRA_OPTS", "TVM_CUDA_NVCC_NO_FAST_MATH")})
        return "executable"

    monkeypatch.setattr(codegen.tvm, "compile", fake_compile)
    assert codegen.build_executable(tvm.IRModule(), devices.target_for(torch.device("cuda")), None) == "executable"
    assert seen == {"TVM_CUDA_NVRTC_EXTRA_OPTS": "-lineinfo " + codegen.EXACT_NVRTC_FLAGS,
                    "TVM_CUDA_NVCC_NO_FAST_MATH": "1"}
    assert os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] == "-lineinfo"
    assert "TVM_CUDA_NVCC_NO_FAST_MATH" not in os.environ


def test_nvrtc_compiles_ieee_division_and_square_root_without_contraction(monkeypatch):
    """What TVM's NVRTC callback makes of a kernel under :func:`exact_cuda_math`: PTX with IEEE
    division and square root, separate multiply and add, no flush-to-zero (where NVRTC and the CUDA
    headers are here; CI has neither)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from tvm.support import nvcc

    from tvmbridge.backend.codegen import exact_cuda_math

    roots = sorted(glob.glob("/usr/local/cuda*/include/cuda_runtime.h"))
    if "CUDA_PATH" not in os.environ:
        if not roots:
            pytest.skip("no CUDA headers")
        monkeypatch.setenv("CUDA_PATH", os.path.dirname(os.path.dirname(roots[-1])))
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        fast = nvcc.compile_cuda(_KERNEL, target_format="ptx", arch="sm_90", compiler="nvrtc").decode()
        with exact_cuda_math():
            exact = nvcc.compile_cuda(_KERNEL, target_format="ptx", arch="sm_90", compiler="nvrtc").decode()
    assert "div.approx" in fast and "sqrt.approx" in fast and ".ftz." in fast  # TVM's default, for contrast
    assert "div.rn.f32" in exact and "sqrt.rn.f32" in exact
    assert ".approx" not in exact and ".ftz" not in exact and "fma.rn" not in exact
