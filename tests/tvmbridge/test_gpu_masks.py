"""Dropout masks on a GPU: the fused CUDA kernel hands its random numbers out one way for a dense,
16-byte-aligned input (vectorized) and another way for any other (a slice ``x[:, 0]``, an offset
or expanded view), so the bridge draws each mask from ones laid out as eager's input was.
The layout is checked here on the CPU; the masks themselves against eager's where a GPU is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

from tvmbridge import compile_training
from tvmbridge.frontend.sites import RandomSite
from tvmbridge.runtime.random import OFFSET_PERIOD, draw, ones_laid_out_as


def _views(device: str) -> dict[str, torch.Tensor]:
    base = torch.randn(3, 17, 24, device=device)
    return {
        "contiguous": base,
        "token 0 (deit's head)": base[:, 0],
        "offset by one": base[..., 1:],
        "offset dense": base.flatten()[5:101],
        "transposed (dense)": base.transpose(1, 2),
        "expanded": torch.randn(1, 24, device=device).expand(4, 24),
    }


def _site(view: torch.Tensor, p: float = 0.3) -> RandomSite:
    return RandomSite("dropout", tuple(view.shape), tuple(view.stride()), view.dtype, p=p, offset=view.storage_offset())


@pytest.mark.parametrize("name", list(_views("cpu")))
def test_ones_take_the_inputs_layout_and_alignment(name):
    view = _views("cpu")[name]
    ones = ones_laid_out_as(_site(view), torch.device("cpu"))
    assert ones.shape == view.shape and ones.stride() == view.stride()
    assert dense(ones) == dense(view)
    assert ones.storage_offset() == view.storage_offset() % OFFSET_PERIOD
    assert (ones.data_ptr() - view.data_ptr()) % 64 == 0  # both storages 64-byte aligned on the CPU
    assert bool((ones == 1).all())


class HeadDropout(torch.nn.Module):
    """deit's head: dropout of token 0 of a normalized sequence, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.head(F.dropout(x[:, 0], 0.5, True) + F.dropout(x[..., 1:, :], 0.5, True).sum(1))


def test_sites_record_the_inputs_layout():
    compiled = compile_training(HeadDropout(), (torch.randn(2, 5, 8),))
    sites = {(s.shape, s.stride, s.offset) for s in compiled.random_sites}
    assert sites == {((2, 8), (40, 1), 0), ((2, 4, 8), (40, 8, 1), 8)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(_views("cpu")))
def test_cuda_masks_equal_eager_dropout(name):
    view = _views("cuda")[name]
    torch.manual_seed(5)
    want = F.dropout(view, 0.3, True) != 0  # where eager kept (the inputs are nonzero)
    torch.manual_seed(5)
    (got,) = draw([_site(view)], torch.device("cuda"))
    assert torch.equal(got != 0, want)
    assert torch.allclose(got[got != 0], torch.tensor(1 / 0.7, device="cuda"))
