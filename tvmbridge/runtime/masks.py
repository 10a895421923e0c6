"""The dropout masks of one call, drawn from PyTorch's RNG the way PyTorch's dropout draws them.

On CPU ``at::dropout`` runs ``noise = empty_like(x).bernoulli_(1-p); noise.div_(1-p)``; on
CUDA/ROCm it runs the fused ``native_dropout`` kernel, whose mask we get by applying it to ones.
Either way the generator advances exactly as in the eager module, in graph order. On CPU a large
float32 ``bernoulli_`` is ``kernels.mt19937.bernoulli_``, the same stream drawn by a vectorized
kernel, where its start-up check passed.
"""
from __future__ import annotations

import torch

from ..devices import torch_dtype
from ..kernels import mt19937
from ..passes.dropout import DropoutSite


def draw_masks(sites: list[DropoutSite], device: torch.device, use_kernel: bool = True) -> list[torch.Tensor]:
    """The scaled masks (``mask * x`` is PyTorch's dropout of ``x``), in graph order."""
    out = []
    fast = use_kernel and device.type == "cpu" and mt19937.kernel_works()
    for s in sites:
        dt = torch_dtype(s.dtype)
        if device.type == "cpu":
            noise = torch.empty(s.shape, dtype=dt, device=device)
            if fast and dt == torch.float32 and noise.numel() >= mt19937.MIN_ELEMENTS:
                mt19937.bernoulli_(noise, 1 - s.p)
            else:
                noise.bernoulli_(1 - s.p)
            noise.div_(1 - s.p)
        else:
            noise = torch.native_dropout(torch.ones(s.shape, dtype=dt, device=device), s.p, True)[0]
        out.append(noise)
    return out
