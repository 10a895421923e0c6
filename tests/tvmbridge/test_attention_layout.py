"""Attention written as users write it (nanoGPT's ``y.transpose(1, 2).contiguous().view(B, T, C)``):
on CPU, ``scaled_dot_product_attention`` traces through the flash kernel, whose output is laid out
(batch, length, heads, dim), so the trace records no copy for ``contiguous()``; the bridge's math
form of attention must hand the ``view`` the same layout. Every call compiled, outputs and
gradients against PyTorch, in train and eval, under no_grad, and through torch.compile."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tvmbridge
from tvmbridge import add_tvm_dispatch
from tvmbridge.frontend.traced_layouts import stride_order

from ..helpers import clone_module, is_tvm, relative_errors, run_step


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 4, dropout: float = 0.0, causal: bool = True):
        super().__init__()
        self.heads, self.kv_heads, self.dropout, self.causal = heads, kv_heads, dropout, causal
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d * kv_heads // heads)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2 * self.kv_heads, -1).transpose(1, 2).split(self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal,
            enable_gqa=self.kv_heads != self.heads,
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


MODULES = {
    "causal": dict(),
    "not_causal": dict(causal=False),
    "grouped_query": dict(kv_heads=2),
    "dropout": dict(dropout=0.1),  # the math kernel in eager: no layout to keep
}


@pytest.mark.parametrize("kind", MODULES)
def test_attention_then_view_trains_like_pytorch(kind):
    torch.manual_seed(0)
    module = CausalSelfAttention(**MODULES[kind])
    x = torch.randn(2, 5, 32)
    ref = clone_module(module)
    add_tvm_dispatch(module, (x,))
    for batch in (x, torch.randn(3, 7, 32)):
        got, want = run_step(module, (batch,)), run_step(ref, (batch,))
        assert is_tvm(got[0][0]), module._tvm_dispatch.explain()
        errs = relative_errors(got, want)
        assert max(errs.values()) <= 1e-5, errs


@pytest.mark.parametrize("grad", [True, False], ids=["eval", "eval_no_grad"])
def test_attention_then_view_in_eval_is_compiled(grad):
    torch.manual_seed(0)
    module = CausalSelfAttention().eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want = module(x)
    add_tvm_dispatch(module, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warns
        with torch.set_grad_enabled(grad):
            got = module(x)
    assert (got - want).abs().max() <= 1e-5
    assert module._tvm_dispatch.calls_fallback == 0 and module._tvm_dispatch.calls_tvm == 1


def test_attention_then_view_through_torch_compile():
    torch.manual_seed(0)
    module = CausalSelfAttention()
    ref = clone_module(module)
    backend = tvmbridge.compile_backend()
    compiled = torch.compile(module, backend=backend)
    x = torch.randn(2, 5, 32)
    for model in (compiled, ref):
        torch.manual_seed(1)
        (model(x) * torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(7))).sum().backward()
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert backend.graphs and all(g.dispatcher.calls_tvm and not g.dispatcher.calls_fallback for g in backend.graphs)
    torch._dynamo.reset()


def test_stride_order_names_the_memory_order():
    flash = torch.empty(2, 5, 4, 8).transpose(1, 2)  # (N, H, L, E) over (N, L, H, E) memory
    assert stride_order(flash) == [0, 2, 1, 3]
    assert stride_order(torch.empty(2, 4, 5, 8)) is None
    assert stride_order(torch.empty(2, 3, 4, 4).to(memory_format=torch.channels_last)) == [0, 2, 3, 1]
    assert stride_order("not a tensor") is None
