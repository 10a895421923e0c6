"""The CUDA build path: both halves compile for target ``cuda`` with nvcc (nothing runs here)."""
from __future__ import annotations

import shutil

import pytest
import torch

from tvmbridge import devices
from tvmbridge.backend import build
from tvmbridge import compile_training

from ..helpers import MLP

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


def _modules(mod):
    stack, seen = [mod], []
    while stack:
        m = stack.pop()
        seen.append(m)
        stack.extend(m.imports)
    return seen


def test_forward_and_backward_compile_for_cuda():
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
