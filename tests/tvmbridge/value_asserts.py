"""A model that asserts a condition on a value read from a tensor, kept out of the test files:
pytest rewrites their ``assert`` statements, and export keeps an assertion as a run-time check only
where it sees Python's own ``assert`` bytecode."""
from __future__ import annotations

import torch


class AssertsLengths(torch.nn.Module):
    """XLM's check: the longest row of the mask no longer than the sequence (a value read from a
    tensor, which export keeps as a run-time assertion); ``check`` writes it as ``torch._check``."""

    def __init__(self, check: bool = False) -> None:
        super().__init__()
        self.emb, self.lin, self.check = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 3), check

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        longest = mask.sum(dim=1).long().max().item()
        if self.check:
            torch._check(longest <= ids.shape[1], lambda: "a row longer than the sequence")
        else:
            assert longest <= ids.shape[1]
        return self.lin(self.emb(ids) * mask[..., None]).sum()
