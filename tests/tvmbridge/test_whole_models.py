"""Whole transformers models train through TVM from their ordinary call, loss included.

Each model is dispatched at the top (``add_tvm_dispatch(model, args, kwargs)`` with the labels),
so embeddings (scatter-add backward), position ids, padding masks, tied input/output embeddings,
attention (SDPA with dropout), BatchNorm in train mode and the loss are all in the compiled
graph; the loss, the logits and every gradient are compared with PyTorch under the same seed.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.helpers import is_tvm
from tvmbridge import add_tvm_dispatch
from tvmbridge.tools.whole_models import WHOLE_MODELS, build_task


def _step(task, model, seed: int = 11):
    torch.manual_seed(seed)
    out = task.call(model)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


@pytest.mark.parametrize("name", WHOLE_MODELS)
def test_one_step_equals_pytorch(name):
    task = build_task(name)
    ref = copy.deepcopy(task.model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback anywhere
        add_tvm_dispatch(task.model, task.args, task.kwargs)
        out, grads = _step(task, task.model)
    want, want_grads = _step(task, ref)
    assert is_tvm(out.loss), "the loss must come from the compiled graph"
    assert torch.allclose(out.loss, want.loss, rtol=1e-5, atol=1e-6), (out.loss, want.loss)
    assert torch.allclose(out.logits, want.logits, rtol=1e-4, atol=1e-5)
    assert grads.keys() == want_grads.keys() and len(grads) == len(list(ref.parameters()))
    for key in grads:
        scale = want_grads[key].abs().max().item() + 1e-6
        err = (grads[key] - want_grads[key]).abs().max().item()
        assert err <= 1e-4 * scale + 1e-7, (key, err, scale)
    for (key, buf), (_, ref_buf) in zip(task.model.named_buffers(), ref.named_buffers()):
        assert torch.allclose(buf.float(), ref_buf.float(), rtol=1e-5, atol=1e-6), key  # BatchNorm statistics


def test_tied_embeddings_get_both_gradients():
    """BERT's decoder weight is its word embedding: one tensor whose gradient sums the
    embedding's scatter-add and the output projection's matmul."""
    task = build_task("bert-mlm")
    model = task.model
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    ref = copy.deepcopy(model)
    add_tvm_dispatch(model, task.args, task.kwargs)
    _, grads = _step(task, model)
    _, want = _step(task, ref)
    key = "bert.embeddings.word_embeddings.weight"
    assert torch.allclose(grads[key], want[key], rtol=1e-4, atol=1e-6)
    rows_read = torch.zeros(grads[key].shape[0], dtype=torch.bool)
    rows_read[task.args[0].unique()] = True
    assert grads[key][~rows_read].abs().sum() > 0, "rows never read still get the decoder's gradient"


@pytest.mark.parametrize("name", ["bert-mlm", "gpt2-lm"])
def test_adamw_losses_follow_pytorch(name):
    """20 AdamW steps with dropout: the same losses as PyTorch under the same seeds."""
    task = build_task(name)
    ref = copy.deepcopy(task.model)
    add_tvm_dispatch(task.model, task.args, task.kwargs)
    curves = []
    for model in (task.model, ref):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(20):
            torch.manual_seed(100 + step)
            loss = task.call(model).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves.append(losses)
    tvm_losses, torch_losses = curves
    assert torch_losses[-1] < torch_losses[0]  # it trains
    for a, b in zip(tvm_losses, torch_losses):
        assert abs(a - b) <= 1e-4 * abs(b), (tvm_losses, torch_losses)


def test_gpt2_returns_its_cache_from_keyword_call():
    """A keyword-only call; the output keeps its type, past key/values included."""
    task = build_task("gpt2-lm")
    ref = copy.deepcopy(task.model)
    add_tvm_dispatch(task.model, sample_kwargs=task.kwargs)
    torch.manual_seed(3)
    out = task.call()
    torch.manual_seed(3)
    want = task.call(ref)
    assert type(out) is type(want) and type(out.past_key_values) is type(want.past_key_values)
    for a, b in zip(out.past_key_values.layers, want.past_key_values.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


def test_class_index_out_of_range_raises():
    """cross_entropy's gather reads a clipped index and raises, as PyTorch does, never reading
    out of bounds."""
    task = build_task("vit-cls")
    add_tvm_dispatch(task.model, task.args, task.kwargs)
    bad = dict(task.kwargs, labels=torch.tensor([3, 10]))  # 10 classes: index 10 is out of range
    with pytest.raises(IndexError):
        task.model(*task.args, **bad)
    with pytest.raises(IndexError):  # as PyTorch's own loss does
        torch.nn.functional.cross_entropy(torch.zeros(2, 10), bad["labels"])


class _Pick(torch.nn.Module):
    """x[:, -1] and x[:, 0] (``select`` with a negative and a 0-d index; the frontend read the
    negative one out of bounds and Relax's take gradient failed on 0-d indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y[:, -1] * 2 + y[:, 0] + y[-1]


def test_select_negative_and_zero_d_index():
    from tests.helpers import clone_module, max_errors, run_step

    m = _Pick()
    ref = clone_module(m)
    x = torch.randn(5, 5, 6)
    add_tvm_dispatch(m, (x,))
    got, want = run_step(m, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0])
    assert max(max_errors(got, want).values()) < 1e-5


class _MaskedSoftmax(torch.nn.Module):
    """A -inf fill (``torch.full``/``where`` with -inf): TVM 0.27's ``topi.full`` raises on a
    non-finite fill (it tests ``"float" in dtype`` on a dtype object); the bridge legalizes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        masked = torch.where(x > 0, x, torch.full((), float("-inf")))
        return torch.softmax(torch.cat([masked, torch.zeros(x.shape[0], 1)], dim=1), dim=-1)


def test_non_finite_fill_builds():
    from tests.helpers import clone_module, max_errors, run_step

    m = _MaskedSoftmax()
    x = torch.randn(4, 5)
    add_tvm_dispatch(m, (x,))
    got, want = run_step(m, (x,)), run_step(clone_module(_MaskedSoftmax()), (x,))
    assert is_tvm(got[0][0]) and max(max_errors(got, want).values()) < 1e-6
