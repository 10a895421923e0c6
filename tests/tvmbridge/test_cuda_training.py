"""Training on a CUDA GPU as a user writes it, against PyTorch on the same GPU: ``model(**batch)``,
an optimizer, gradient clipping, a changing batch, dropout, BatchNorm, eval under ``no_grad``, a model
moved to the GPU after the dispatch was added, and ``torch.compile(backend="tvmbridge")``.

The user loop also runs on the CPU (the test itself checked where no GPU is); every case runs on
CUDA where a GPU is (the device tool's machines).
TF32 is off for eager's convolutions and matmuls: the bridge computes in float32.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tvmbridge import FallbackWarning, add_tvm_dispatch, compile_backend

from ..helpers import bert_inputs, bert_layer

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_gpu)]


@contextlib.contextmanager
def _strict_float32() -> Iterator[None]:
    """No TF32 in eager (restored after), and any fallback or discarded variant fails the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class Classifier(nn.Module):
    """A small image-and-token model: conv + BatchNorm + GELU, attention over the pixels, dropout,
    LayerNorm, a head; returns (loss, logits) when labels are given, like HF models."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)  # before BatchNorm, as CNNs do
        self.bn = nn.BatchNorm2d(16)
        self.dw = nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16)
        self.qkv = nn.Linear(16, 48)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> tuple:
        h = self.dw(F.gelu(self.bn(self.stem(pixel_values))))
        t = h.flatten(2).transpose(1, 2)  # (batch, tokens, 16)
        q, k, v = self.qkv(t).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v)
        t = self.norm(t + F.dropout(a, 0.1, self.training))
        logits = self.head(t.mean(1))
        if labels is None:
            return (logits,)
        return F.cross_entropy(logits, labels), logits


def _batch(n: int, size: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(n, 3, size, size, generator=g).to(device),
            "labels": torch.randint(0, 5, (n,), generator=g).to(device)}


def _train(model: nn.Module, batches: list[dict], seed: int = 0) -> list[float]:
    """The user's loop: an optimizer, clipping, one seeded step per batch; the losses. SGD: Adam's
    normalized step turns float noise in a gradient that is zero in exact arithmetic (the key's bias
    under softmax) into a full-size update, in eager as much as in the bridge."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    losses = []
    for i, batch in enumerate(batches):
        torch.manual_seed(seed + i)
        loss, _ = model(**batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_same_state(got: nn.Module, want: nn.Module) -> None:
    for (name, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_user_training_loop_matches_eager(device: str) -> None:
    torch.manual_seed(0)
    eager = Classifier().to(device)
    tvm = copy.deepcopy(eager)
    batches = [_batch(4, 16, 1, device), _batch(6, 16, 2, device), _batch(4, 12, 3, device)]
    with _strict_float32():
        add_tvm_dispatch(tvm, sample_kwargs=batches[0], verify=False)
        got, want = _train(tvm, batches), _train(eager, batches)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
        _assert_same_state(tvm, eager)
        tvm.eval(), eager.eval()
        with torch.no_grad():
            x = _batch(3, 16, 4, device)["pixel_values"]
            torch.testing.assert_close(tvm(x)[0], eager(x)[0], rtol=1e-4, atol=1e-5)
    assert all(v.compiled.device.type == device for v in tvm._tvm_dispatch.variants)


@needs_gpu
def test_a_model_moved_after_the_dispatch_runs_where_it_now_lives(device: str = "cuda") -> None:
    """``add_tvm_dispatch`` on the CPU, then ``model.to(device)``: calls on the new device must use
    the moved parameters (a variant for that device), not the CPU copies the first compile saw."""
    torch.manual_seed(0)
    eager = Classifier()
    tvm = copy.deepcopy(eager)
    with _strict_float32():
        add_tvm_dispatch(tvm, sample_kwargs=_batch(2, 8, 1, "cpu"), verify=False)
        eager.to(device), tvm.to(device)
        with torch.no_grad():
            tvm.head.weight.mul_(2), eager.head.weight.mul_(2)  # state changed after the move too
        batches = [_batch(2, 8, 5, device), _batch(2, 8, 6, device)]
        torch.testing.assert_close(torch.tensor(_train(tvm, batches)), torch.tensor(_train(eager, batches)),
                                   rtol=1e-4, atol=1e-5)
        _assert_same_state(tvm, eager)


@needs_gpu
def test_torch_compile_backend_trains_a_bert_layer(device: str = "cuda") -> None:
    """The CPU case is ``test_compile_backend``'s; here every graph must run on the GPU's TVM."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = bert_layer(small=True).to(device)
    model = copy.deepcopy(eager)
    backend = compile_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x, mask = (t.to(device) for t in bert_inputs(batch=2, seq=16, hidden=64))
    w = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2)).to(device)
    try:
        with _strict_float32():
            for m in (compiled, eager):
                torch.manual_seed(3)
                out = m(x, mask)
                (out[0] if isinstance(out, tuple) else out).mul(w).sum().backward()
        assert backend.graphs and all(g.dispatcher.calls_tvm > 0 and g.dispatcher.calls_fallback == 0
                                      for g in backend.graphs), backend.explain()
    finally:
        torch._dynamo.reset()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


class ConstantInForward(nn.Module):
    """HF's GPT-Neo/Falcon/MPNet make tensors in forward on the input's device (a mask value, a
    scale): torch.export lifts each as a constant of the graph, on the GPU where the call is."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([0.5, 2.0] * 4, device=x.device)
        return self.norm(self.proj(x) * scale + torch.tensor(1.0, device=x.device))


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_made_in_forward_on_the_device(device: str) -> None:
    torch.manual_seed(0)
    eager = ConstantInForward().to(device)
    tvm = copy.deepcopy(eager)
    x = torch.randn(3, 8, device=device)
    with _strict_float32():
        add_tvm_dispatch(tvm, (x,), verify=False)
        for m in (tvm, eager):
            m(x).pow(2).sum().backward()
    assert tvm._tvm_dispatch.calls_tvm == 1
    for (name, p), q in zip(tvm.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@needs_gpu
def test_a_call_on_a_side_stream_waits_for_nothing_it_should_not(device: str = "cuda") -> None:
    """Training under ``torch.cuda.stream(s)``: PyTorch's streams do not wait for the legacy
    default stream, so TVM's kernels must run on the caller's stream (forward, and the backward
    autograd runs on the forward's stream), or a result can be read before it is written."""
    torch.manual_seed(0)
    eager = bert_layer(small=True).to(device)
    tvm = copy.deepcopy(eager)
    x, mask = (t.to(device) for t in bert_inputs(batch=8, seq=64, hidden=64))
    add_tvm_dispatch(tvm, (x, mask), verify=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with _strict_float32(), torch.cuda.stream(side):
        for m in (tvm, eager):
            torch.manual_seed(3)
            out = m(x, mask)
            out = out[0] if isinstance(out, tuple) else out
            out.square().sum().backward()
            # read at once on the side stream, as an optimizer or clipping would
            m.norms = torch.stack([p.grad.norm() for p in m.parameters()])
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(tvm.norms, eager.norms, rtol=1e-4, atol=1e-5)
    assert tvm._tvm_dispatch.calls_tvm == 1
