"""Shared fixtures: small modules and a reference-vs-TVM comparison helper."""
from __future__ import annotations

import copy

import pytest
import torch


def bert_layer(dtype: torch.dtype = torch.float32, small: bool = False) -> torch.nn.Module:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128) if small else BertConfig()
    cfg._attn_implementation = "eager"
    return BertLayer(cfg).train().to(dtype)


def clone_module(m: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with the same weights (the PyTorch reference)."""
    return copy.deepcopy(m)


def run_step(module, args, grad_seed: int = 7, rng_seed: int = 1):
    """Forward under a fixed RNG seed, backward with a fixed random output gradient; returns the
    output and the grads of the float inputs and all parameters."""
    args = tuple(
        a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
        for a in args
    )
    torch.manual_seed(rng_seed)
    out = module(*args)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(grad_seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
    loss.backward()
    grads = {f"input{i}": a.grad for i, a in enumerate(args) if getattr(a, "grad", None) is not None}
    grads.update({n: p.grad.clone() for n, p in module.named_parameters()})
    for p in module.parameters():
        p.grad = None
    return outs, grads


def max_errors(a, b) -> dict[str, float]:
    outs_a, grads_a = a
    outs_b, grads_b = b
    errs = {f"out{i}": (x - y).abs().max().item() for i, (x, y) in enumerate(zip(outs_a, outs_b))}
    assert grads_a.keys() == grads_b.keys()
    errs.update({k: (grads_a[k] - grads_b[k]).abs().max().item() for k in grads_a})
    return errs


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield
