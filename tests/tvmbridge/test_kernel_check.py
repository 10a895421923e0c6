"""No CPU schedule changes what a kernel computes: every scheduled kernel of real layers'
training compiles (rotary attention, a BertLayer, a depthwise CNN block) against its own
unscheduled form on random inputs. A RoPE gradient kernel was once off by 1e29 this way."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import bert_inputs, bert_layer
from tvmbridge import add_tvm_dispatch
from tvmbridge.tools.kernel_check import check_kernels


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(torch.nn.Module):
    """Llama's attention pattern: q/k projections, heads split, rotary embedding, transposes."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
        k = self.k(x).view(b, n, 2, 8).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)).softmax(-1).transpose(1, 2).reshape(b, n, -1)


class DepthwiseBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dw = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.bn = torch.nn.BatchNorm2d(8)
        self.pw = torch.nn.Conv2d(8, 16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.hardswish(self.bn(self.dw(x)))
        return self.pw(h * torch.sigmoid(h.mean((2, 3), keepdim=True)))


@pytest.mark.parametrize("make,inputs", [
    (Rotary, lambda: (torch.randn(2, 6, 32), torch.randn(6, 8), torch.randn(6, 8))),
    (lambda: bert_layer(small=True), lambda: bert_inputs(hidden=64, batch=2, seq=6)),
    (DepthwiseBlock, lambda: (torch.randn(2, 8, 7, 7),)),
], ids=["rotary", "bert-layer", "depthwise"])
def test_every_scheduled_kernel_computes_what_its_unscheduled_form_does(make, inputs) -> None:
    torch.manual_seed(0)
    m = add_tvm_dispatch(make().train(), inputs(), verify=False)
    diffs = check_kernels(m._tvm_dispatch.compiled)
    assert len(diffs) >= 5
    bad = [d for d in diffs if not d.ok]
    assert not bad, bad
