"""Slicing and ranges against PyTorch over a grid: stepped slices (Swin's patch merging), their
gradients (float64, to 1e-12), and slices/ranges sized by a symbolic length (position ids cut to
the input's length, ``arange(seq)``) in one variant for every length."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tvmbridge import add_tvm_dispatch

STARTS = (None, 0, 1, 2, -3)
STOPS = (None, -1, 5)
STEPS = (1, 2, 3, 4)


class ManySlices(torch.nn.Module):
    """Every (start, stop, step) of the grid along axis 1, each weighted and summed."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, size, 4, dtype=torch.float64))
        self.cases = [c for c in itertools.product(STARTS, STOPS, STEPS)
                      if torch.empty(size)[slice(*c)].numel() > 0]  # empty slices run PyTorch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w
        total = y.new_zeros(())
        for k, case in enumerate(self.cases):
            part = y[:, slice(*case)]
            total = total + (part * (k + 1)).pow(2).sum() + part[::2, :, 1::2].sum()
        return total


@pytest.mark.parametrize("size", [1, 2, 7, 8])
def test_stepped_slices_and_their_gradients(size: int) -> None:
    torch.manual_seed(size)
    eager = ManySlices(size)
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    x = torch.randn(3, size, 4, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    got, want = tvm(x), eager(x2)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tvm.w.grad, eager.w.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)


class Positions(torch.nn.Module):
    """HF's pattern: a position buffer cut to the input's length, a mask built from ``arange``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(32).unsqueeze(0), persistent=False)
        self.pos = torch.nn.Embedding(32, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        h = x + self.pos(self.position_ids[:, :seq])
        causal = torch.arange(seq)[None, :] <= torch.arange(seq)[:, None]
        scores = (self.lin(h) @ h.transpose(1, 2)).masked_fill(~causal[:, :seq], -1e4)
        return scores.softmax(-1)[..., :seq] @ h


def test_symbolic_slices_and_ranges_serve_every_length() -> None:
    torch.manual_seed(0)
    eager = Positions()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    for seq in (6, 9, 13, 4):
        x = torch.randn(2, seq, 8)
        for m in (tvm, eager):
            m.zero_grad(set_to_none=True)
        got, want = tvm(x), eager(x)
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(tvm.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    variants = tvm._tvm_dispatch.variants
    assert len(variants) == 2 and variants[1].symbolic, tvm._tvm_dispatch.explain()


class PartialRotary(torch.nn.Module):
    """Phi-3's pattern: ``x[..., :rot]`` rotated, ``x[..., rot:]`` passed through and concatenated
    back; with ``rot`` the whole head the pass-through part is empty along the axis."""

    def __init__(self, rot: int) -> None:
        super().__init__()
        self.rot = rot
        self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        rotated, passed = h[..., :self.rot], h[..., self.rot:]
        half = self.rot // 2
        rotated = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1) * 0.5 + rotated
        return torch.cat((rotated, passed), dim=-1).pow(2).sum()


@pytest.mark.parametrize("rot", [8, 4])
def test_empty_cat_parts_are_dropped_not_refused(rot: int) -> None:
    torch.manual_seed(rot)
    eager = PartialRotary(rot)
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False, fallback=False)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    got, want = tvm(x), eager(x2)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tvm.lin.weight.grad, eager.lin.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
