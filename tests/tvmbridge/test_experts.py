"""Mixture-of-experts routing (``frontend/converters/experts.py``): ``histc`` and grouped matrix
products, whose group sizes come from the data, at static shapes; outputs and every gradient in
float64 against PyTorch (every transformers MoE model was refused at these ops)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tvmbridge import UnsupportedOpError, add_tvm_dispatch

from ..helpers import Fn
from .test_gradients_nn import check, randn

transformers_moe = pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback


@pytest.mark.parametrize("bins,low,high", [(7, -1.0, 1.0), (4, 0.0, 3.0), (3, -7.0, 7.0), (5, 0.3, 0.4)])
def test_histc_bins_as_aten(bins, low, high):
    """Edges on bin boundaries, values outside the range, the closed last bin; the counts
    multiply ``x`` so its gradient is them too."""
    x = torch.tensor([-7.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 3.5, 7.0, 0.25, 1 / 3], dtype=torch.float64)
    check(Fn(lambda x: x[:bins] * torch.histc(x, bins=bins, min=low, max=high)), x)


@pytest.mark.parametrize("low,high", [(0.0, 0.0), (0.5, 0.5)])
def test_histc_with_the_data_range_is_refused(low, high):
    """``min == max`` (the default): ATen bins over the data's own range."""
    with pytest.raises(UnsupportedOpError, match="histc without min < max"):
        add_tvm_dispatch(Fn(lambda x: x * torch.histc(x, bins=4, min=low, max=high).sum()), (randn(8),))


class Experts(nn.Module):
    """transformers' grouped-experts routing, written out: top-k of a router, rows sorted by
    expert, tokens per expert by ``histc``, two grouped products, weighted back per token.
    ``sentinel``: the last expert's rows fall past the final offset, as under expert parallelism."""

    def __init__(self, grouped_mm, experts: int = 4, top_k: int = 2, hidden: int = 6, sentinel: bool = False) -> None:
        super().__init__()
        self.grouped_mm, self.experts, self.top_k, self.sentinel = grouped_mm, experts, top_k, sentinel
        self.router = nn.Linear(hidden, experts, dtype=torch.float64)
        self.up = nn.Parameter(randn(experts, hidden, 10, seed=3))
        self.down = nn.Parameter(randn(experts, 10, hidden, seed=4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        ids, perm = torch.sort(chosen.reshape(-1))
        rows = x[perm // self.top_k]
        counted = torch.where(ids == self.experts - 1, self.experts, ids) if self.sentinel else ids
        per_expert = torch.histc(counted.double(), bins=self.experts, min=0, max=self.experts - 1)
        offsets = torch.cumsum(per_expert, 0, dtype=torch.int32)
        out = self.grouped_mm(torch.relu(self.grouped_mm(rows, self.up, offsets)), self.down, offsets)
        out = out * weights.reshape(-1)[perm, None]
        return torch.zeros_like(x).index_add(0, perm // self.top_k, out)


@pytest.mark.parametrize("sentinel", [False, True], ids=["all_experts", "rows_past_the_last_offset"])
def test_grouped_experts_train(sentinel):
    torch.manual_seed(0)
    check(Experts(torch.ops.transformers.grouped_mm_fallback, sentinel=sentinel), randn(9, 6))
