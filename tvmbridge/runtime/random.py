"""The random inputs of one call, drawn from PyTorch's generator the way PyTorch draws them.

In graph order, site by site, so the generator advances exactly as in the eager module:

* a dropout's scaled mask as ``at::dropout`` makes it on CPU (``noise = empty_like(x)`` (same
  strides, so a channels_last input draws in memory order) ``.bernoulli_(1-p).div_(1-p)``); a
  large contiguous float32 one by ``kernels.mt19937``, the same stream drawn vectorized, where its
  start-up check passed. On CUDA/ROCm the fused ``native_dropout`` kernel on ones;
* any other random op by calling the same aten op with empty tensors of the recorded layout in
  place of its tensor arguments (whose values it does not read).
"""
from __future__ import annotations

import torch

from ..frontend.importer import RandomSite, TensorMeta
from ..kernels import mt19937


def _empty_like_meta(m: TensorMeta, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=device)


def _dropout_mask(site: RandomSite, device: torch.device, fast: bool) -> torch.Tensor:
    keep = 1 - site.p
    noise = torch.empty_strided(site.shape, site.stride, dtype=site.dtype, device=device)
    if device.type != "cpu":
        noise.fill_(1)
        return torch.native_dropout(noise, site.p, True)[0]
    if fast and site.dtype == torch.float32 and noise.is_contiguous() and noise.numel() >= mt19937.MIN_ELEMENTS:
        mt19937.bernoulli_(noise, keep)
    else:
        noise.bernoulli_(keep)
    return noise.div_(keep)


def _replay(site: RandomSite, device: torch.device) -> torch.Tensor:
    def arg(v: object) -> object:
        return _empty_like_meta(v, device) if isinstance(v, TensorMeta) else v

    return site.op(*[arg(a) for a in site.args], **{k: arg(v) for k, v in site.kwargs.items()})


def draw(sites: list[RandomSite], device: torch.device, use_kernel: bool = True) -> list[torch.Tensor]:
    """The values of ``sites`` for one call, in order."""
    fast = use_kernel and device.type == "cpu" and bool(sites) and mt19937.kernel_works()
    return [_dropout_mask(s, device, fast) if s.kind == "dropout" else _replay(s, device) for s in sites]
