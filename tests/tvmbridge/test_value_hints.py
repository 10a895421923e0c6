"""``nn.Transformer`` as its tutorial uses it: ``nn.TransformerEncoder``/``Decoder`` compare the
mask they are given with a causal one (``bool((mask == causal).all())``) to pass attention an
``is_causal`` hint, a read of tensor values ``torch.export`` cannot trace: a translation model
with ``tgt_mask`` and a GPT written with ``nn.TransformerEncoder`` and
``generate_square_subsequent_mask`` did not compile. Every call compiled, with padding masks,
dropout and a changing length, outputs and gradients against PyTorch; in eval under no_grad too."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import transformer

from tvmbridge import add_tvm_dispatch
from tvmbridge.frontend.value_hints import value_free_hints

from ..helpers import clone_module


class Translator(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.tf = nn.Transformer(d, 2, 1, 1, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1] - 1)
        h = self.tf(
            self.emb(src),
            self.emb(tgt[:, :-1]),
            tgt_mask=mask,
            src_key_padding_mask=src == 0,
            memory_key_padding_mask=src == 0,
        )
        return F.cross_entropy(self.head(h).flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=0)


class EncoderGPT(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, hint: bool | None = None) -> None:
        super().__init__()
        self.hint = hint
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, 0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        h = self.enc(self.emb(ids), mask=mask, is_causal=self.hint)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def batch(kind: str, b: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a, c = torch.randint(1, 40, (b, n), generator=g), torch.randint(1, 40, (b, n + 1), generator=g)
    if kind == "translator":
        a[-1, -2:] = 0  # padding
        c[-1, -2:] = 0
    return a, c[:, :n] if kind != "translator" else c


MODELS = {"translator": Translator, "encoder_gpt": EncoderGPT, "encoder_gpt_hinted": lambda: EncoderGPT(hint=True)}


@pytest.mark.parametrize("kind", MODELS)
def test_transformer_with_a_mask_trains_compiled(kind):
    torch.manual_seed(0)
    model = MODELS[kind]()
    ref = clone_module(model)
    add_tvm_dispatch(model, batch(kind.split("_hinted")[0], 2, 5, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback or a discarded variant warns
        warnings.filterwarnings("ignore", message=".*nested tensors")  # eager's eval fast path
        for step, (b, n) in enumerate([(2, 5), (3, 7)]):
            args = batch(kind.split("_hinted")[0], b, n, step)
            losses = []
            for m in (model, ref):
                m.zero_grad()
                torch.manual_seed(step)
                loss = m(*args)
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        model.eval(), ref.eval()
        with torch.no_grad():
            args = batch(kind.split("_hinted")[0], 2, 6, 9)
            torch.testing.assert_close(model(*args), ref(*args), rtol=1e-5, atol=1e-6)
    assert model._tvm_dispatch.calls_fallback == 0 and model._tvm_dispatch.calls_tvm == 3


def test_the_detection_is_value_free_only_in_the_tracing_thread_and_restored_after():
    original = transformer._detect_is_causal_mask
    causal = nn.Transformer.generate_square_subsequent_mask(4)
    seen: dict[str, bool] = {}
    with value_free_hints():
        assert transformer._detect_is_causal_mask(causal) is False  # the mask applied as given
        assert transformer._detect_is_causal_mask(causal, True) is True
        other = threading.Thread(target=lambda: seen.update(other=transformer._detect_is_causal_mask(causal)))
        other.start()
        other.join()
    assert seen == {"other": True}  # another thread keeps PyTorch's detection
    assert transformer._detect_is_causal_mask is original


class RoundStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.round()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad


def test_a_custom_function_is_still_refused_and_every_patch_undone():
    """The other trace-time patch (``Function.apply`` recording) shares the mechanism."""
    from torch.autograd.function import Function

    from tvmbridge import ConversionError

    apply, detect = Function.__dict__["apply"], transformer._detect_is_causal_mask
    model = nn.Sequential(nn.Linear(3, 3))
    model.forward = lambda x: RoundStraightThrough.apply(model[0](x))  # type: ignore[method-assign]
    with pytest.raises(ConversionError, match="RoundStraightThrough"):
        add_tvm_dispatch(model, (torch.randn(2, 3),))
    assert Function.__dict__["apply"] is apply and transformer._detect_is_causal_mask is detect


class EmaThroughData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.ema.data.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return h - self.ema


class EmaUnderNoGrad(EmaThroughData):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.ema


def test_a_write_through_data_is_refused_with_the_form_that_compiles() -> None:
    from tvmbridge import ConversionError

    with pytest.raises(ConversionError, match=r"writes a tensor through \.data.*torch\.no_grad"):
        add_tvm_dispatch(EmaThroughData(), (torch.randn(3, 4),))
    torch.manual_seed(0)
    model = EmaUnderNoGrad()
    ref = EmaUnderNoGrad()
    ref.load_state_dict(model.state_dict())
    add_tvm_dispatch(model, (torch.randn(3, 4),))
    for _ in range(3):
        x = torch.randn(3, 4)
        torch.testing.assert_close(model(x), ref(x))
    torch.testing.assert_close(model.ema, ref.ema)
    assert model._tvm_dispatch.calls_tvm == 3


def test_a_data_dependent_branch_is_named_by_its_line_in_either_of_torchs_messages() -> None:
    """torch names the branching line in a "following call" block, or only as "Caused by: (path:line
    in f)" (transformers' LED), relative to a directory on sys.path; a torch-internal cause is
    not the user's line."""
    import json

    from tvmbridge.frontend.value_hints import data_dependent_hint

    path = json.__file__
    line = 1 + next(i for i, t in enumerate(open(path).read().splitlines()) if t.startswith("def dumps("))
    relative = "json/" + path.rsplit("/", 1)[1]
    hint = data_dependent_hint(RuntimeError(f"guard failed\nCaused by: ({relative}:{line} in dumps)\nmore"))
    assert f"at __init__.py:{line}: `def dumps(" in hint
    block = 'The following call raised this error:\n  File "/x/model.py", line 7, in forward\n    if h.sum() > 0:'
    assert "at model.py:7: `if h.sum() > 0:`" in data_dependent_hint(RuntimeError("Caused by: (_export/non_strict_utils.py:1 in f)\n" + block))
    assert "(at" not in data_dependent_hint(RuntimeError("Caused by: (torch/_refs/__init__.py:3 in f)"))
