"""The random inputs of one call, drawn from PyTorch's generator the way PyTorch draws them.

In graph order, site by site, so the generator advances exactly as in the eager module:

* a dropout's scaled mask as ``at::dropout`` makes it on CPU (``noise = empty_like(x)`` (same
  strides, so a channels_last input draws in memory order) ``.bernoulli_(1-p).div_(1-p)``); a
  large contiguous one by ``kernels.mt19937``, the same stream drawn vectorized, where its
  start-up check passed (a bfloat16/float16 mask drawn in float32 and converted: ATen's
  ``bernoulli_`` samples in double whatever the dtype, checked once per dtype). On CUDA/ROCm the fused
  ``native_dropout`` kernel on ones laid out as eager's input was (:func:`ones_laid_out_as`);
* any other random op by calling the same aten op with empty tensors of the recorded layout in
  place of its tensor arguments (whose values it does not read).
"""

from __future__ import annotations

import functools

import torch

from ..frontend.sites import RandomSite, SizeList, TensorMeta, int_dims
from ..kernels import mt19937


def _empty_like_meta(m: TensorMeta, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(int_dims(m.shape), int_dims(m.stride), dtype=m.dtype, device=device)


def _dropout_mask(site: RandomSite, device: torch.device, fast: bool) -> torch.Tensor:
    keep = 1 - site.p
    # eager's noise is ``empty_like(input)``: the input's strides where they are dense, else
    # contiguous (an expanded input, stride 0: XLNet's position embeddings)
    if device.type != "cpu":
        return torch.native_dropout(ones_laid_out_as(site, device), site.p, True)[0]
    shape, stride = int_dims(site.shape), int_dims(site.stride)
    noise = torch.empty_like(torch.empty_strided(shape, stride, dtype=site.dtype, device=device))
    if fast and noise.is_contiguous() and noise.numel() >= mt19937.MIN_ELEMENTS and draws_like_float32(site.dtype):
        if site.dtype == torch.float32:
            mt19937.bernoulli_(noise, keep)
        else:  # the same 0/1 values, drawn in float32 and converted exactly
            noise.copy_(mt19937.bernoulli_(torch.empty(noise.shape), keep))
    else:
        noise.bernoulli_(keep)
    return noise.div_(keep)


OFFSET_PERIOD = 64  # elements: keeps a storage offset's alignment to 64 bytes and more, for any dtype


def ones_laid_out_as(site: RandomSite, device: torch.device) -> torch.Tensor:
    """Ones with the strides of the dropout's input as traced, starting at its storage offset
    modulo :data:`OFFSET_PERIOD`. The fused CUDA/ROCm dropout kernel hands its random numbers
    out to elements one way for a dense input whose first element is 16-byte aligned (vectorized)
    and another way otherwise (a slice ``x[:, 0]``, an expanded or an offset view), so the
    same mask needs an input that takes the same kernel as eager's did."""
    shape, stride = int_dims(site.shape), int_dims(site.stride)
    offset = int(site.offset) % OFFSET_PERIOD
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride)) if all(n > 0 for n in shape) else 0
    storage = torch.ones(offset + extent, dtype=site.dtype, device=device)  # filled before any overlap
    return storage.as_strided(shape, stride, offset)


@functools.cache
def draws_like_float32(dtype: torch.dtype) -> bool:
    """Whether ``bernoulli_`` on a ``dtype`` tensor draws the same values from the same stream as
    on a float32 one (ATen samples in double whatever the dtype; checked once per dtype), so an
    autocast model's bfloat16 masks can come from the float32 kernel."""
    if dtype == torch.float32:
        return True
    if not dtype.is_floating_point:
        return False
    saved = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        low = torch.empty(4099, dtype=dtype).bernoulli_(0.7)
        after_low = torch.get_rng_state()
        torch.manual_seed(0)
        wide = torch.empty(4099).bernoulli_(0.7)
        return bool(torch.equal(low.float(), wide) and torch.equal(after_low, torch.get_rng_state()))
    finally:
        torch.set_rng_state(saved)


def _replay(site: RandomSite, device: torch.device) -> torch.Tensor:
    def arg(v: object) -> object:
        if isinstance(v, SizeList):
            return v.value()
        return _empty_like_meta(v, device) if isinstance(v, TensorMeta) else v

    return site.op(*[arg(a) for a in site.args], **{k: arg(v) for k, v in site.kwargs.items()})


def draw(sites: list[RandomSite], device: torch.device, use_kernel: bool = True) -> list[torch.Tensor]:
    """The values of ``sites`` for one call, in order."""
    fast = use_kernel and device.type == "cpu" and bool(sites) and mt19937.kernel_works()
    return [_dropout_mask(s, device, fast) if s.kind == "dropout" else _replay(s, device) for s in sites]
