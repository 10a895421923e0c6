"""Helpers the tests share: reference modules, one training step under fixed seeds, error maps.

Every bridge test compares against PyTorch itself: the same module deep-copied (:func:`clone_module`)
and run with the same RNG seed and the same output gradient (:func:`run_step`).
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch

from analysis.models import bert_layer as zoo_bert_layer
from analysis.models import bert_layer_inputs

# Small sizes of the zoo's profiler models, for tests that run them for real.
SMALL_SIZES = {
    "cnn": dict(batch=2, size=16),
    "bert": dict(batch=2, seq=16, hidden=64, heads=4),
    "gpt2": dict(batch=2, seq=16, hidden=64, heads=4),
}


def bert_layer(dtype: torch.dtype = torch.float32, small: bool = False) -> torch.nn.Module:
    """BERT-base's layer, or a small one (hidden 64, 4 heads, intermediate 128)."""
    return zoo_bert_layer(64, 4, 128, dtype=dtype) if small else zoo_bert_layer(dtype=dtype)


def bert_inputs(dtype: torch.dtype = torch.float32, batch: int = 1, seq: int = 14,
                hidden: int = 768) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded-batch inputs from a fixed generator (the same in every test)."""
    return bert_layer_inputs(batch, seq, hidden, dtype, generator=torch.Generator().manual_seed(3))


def clone_module(m: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with the same weights (the PyTorch reference)."""
    return copy.deepcopy(m)


def is_tvm(out: torch.Tensor) -> bool:
    """The output came from the bridge's autograd Function."""
    return out.grad_fn is not None and type(out.grad_fn).__name__ == "TVMFunctionBackward"


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
    """Max abs difference of every output and every gradient of two :func:`run_step` results."""
    outs_a, grads_a = a
    outs_b, grads_b = b

    def err(x: torch.Tensor, y: torch.Tensor) -> float:
        assert x.shape == y.shape, (x.shape, y.shape)
        return (x - y).abs().max().item() if x.numel() else 0.0

    errs = {f"out{i}": err(x, y) for i, (x, y) in enumerate(zip(outs_a, outs_b))}
    assert grads_a.keys() == grads_b.keys()
    errs.update({k: err(grads_a[k], grads_b[k]) for k in grads_a})
    return errs


def relative_errors(a, b) -> dict[str, float]:
    """Like :func:`max_errors`, each divided by max(1, the reference's largest magnitude)."""
    outs_b, grads_b = b
    scale = {f"out{i}": y.abs().max().item() if y.numel() else 0.0 for i, y in enumerate(outs_b)}
    scale.update({k: v.abs().max().item() if v.numel() else 0.0 for k, v in grads_b.items()})
    return {k: v / max(1.0, scale[k]) for k, v in max_errors(a, b).items()}


class Fn(torch.nn.Module):
    """A function of the call's tensors as a module."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class MLP(torch.nn.Module):
    """Linear, GELU, LayerNorm, dropout, Linear: the smallest module with every pass at work."""

    def __init__(self, d=32, h=64):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, h)
        self.act = torch.nn.GELU()
        self.norm = torch.nn.LayerNorm(h)
        self.drop = torch.nn.Dropout(0.25)
        self.fc2 = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(self.drop(self.norm(self.act(self.fc1(x)))))


class TwoOutputs(torch.nn.Module):
    """Two outputs and a float argument with a default."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 8)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x, scale: float = 2.0):
        h = torch.tanh(self.a(x))
        return h * scale, torch.nn.functional.gelu(self.b(x), approximate="tanh").softmax(-1)


@contextlib.contextmanager
def strict_net() -> Iterator[None]:
    """Any discarded variant (the net caught a wrong result) or fallback fails the test."""
    from tvmbridge import FallbackWarning, VerificationWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", VerificationWarning)
        warnings.simplefilter("error", FallbackWarning)
        yield
