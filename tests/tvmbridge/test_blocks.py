"""Other transformer blocks and ops whose gradients Relax lacks (registered by the bridge)."""
from __future__ import annotations

import pytest
import torch

from tvmbridge import add_tvm_dispatch

from ..helpers import clone_module, is_tvm, max_errors, run_step


def _check(module, args, tol=1e-5):
    ref = clone_module(module)
    add_tvm_dispatch(module, args)
    got, want = run_step(module, args), run_step(ref, args)
    assert is_tvm(got[0][0])
    errs = max_errors(got, want)
    assert max(errs.values()) <= tol, errs


def test_gpt2_block():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=64, n_head=4, n_positions=32)
    cfg._attn_implementation = "eager"
    _check(GPT2Block(cfg).train(), (torch.randn(2, 8, 64),))


def test_vit_layer():
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTLayer

    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128)
    cfg._attn_implementation = "eager"
    _check(ViTLayer(cfg).train(), (torch.randn(2, 9, 64),))


class Slicing(torch.nn.Module):
    """strided_slice, squeeze, rsqrt, erf and tanh-GELU: gradients the bridge registers."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        a = h[:, 2:10]                      # strided_slice
        b = h[:, :1].squeeze(1)             # squeeze
        c = torch.rsqrt(h.pow(2) + 1.0)     # rsqrt
        d = torch.erf(h) + torch.nn.functional.gelu(h, approximate="tanh")
        return a.sum(-1) + b + c.mean(-1) + d.mean(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_registered_gradients(dtype, tol):
    torch.manual_seed(0)
    _check(Slicing().to(dtype), (torch.randn(4, 16, dtype=dtype),), tol)
