"""A Python branch on a tensor's values compiles for the way the sample went; a call that goes the
other way runs PyTorch (which raises, or takes the other branch), never the compiled branch."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import Fn, strict_net
from tvmbridge import ConversionError, FallbackWarning, add_tvm_dispatch


class Validated(nn.Module):
    """transformers' CTC heads (wav2vec2, HuBERT, SEW): ``if labels.max() >= vocab: raise``."""

    def __init__(self, vocab: int = 5) -> None:
        super().__init__()
        self.vocab = vocab
        self.head = nn.Linear(4, vocab)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.max() >= self.vocab:
            raise ValueError(f"Label values must be < vocab_size: {self.vocab}")
        return F.cross_entropy(self.head(x), labels)


class Branchy(nn.Module):
    """Two different computations chosen by the values: a bool read and a float read."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if (x > 0).all():
            y = y * 2
        if y.abs().max() > 2.5:  # a bool read of a float comparison
            y = y / 4
        return y.tanh()


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def test_a_validation_branch_compiles_and_a_bad_call_raises_as_pytorch_does() -> None:
    torch.manual_seed(0)
    model, ref = Validated(), Validated()
    ref.load_state_dict(model.state_dict())
    x, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 4, 0])
    add_tvm_dispatch(model, (x, labels))
    with strict_net():
        model(x, labels).backward()
    ref(x, labels).backward()
    assert model._tvm_dispatch.calls_tvm == 1
    for got, want in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(got, want)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="Label values must be < vocab_size"):
        warnings.simplefilter("ignore", FallbackWarning)
        model(x, torch.tensor([0, 1, 2, 3, 5, 0]))
    assert (model._tvm_dispatch.calls_tvm, model._tvm_dispatch.calls_fallback) == (1, 1)


@pytest.mark.parametrize("sample_sign", [1.0, -1.0])
def test_a_call_that_branches_the_other_way_runs_pytorch(sample_sign: float) -> None:
    torch.manual_seed(1)
    model, ref = Branchy(), Branchy()
    ref.load_state_dict(model.state_dict())
    sample = sample_sign * (torch.rand(3, 4) + 0.1)
    add_tvm_dispatch(model, (sample,))
    calls = [sample, -sample, sample * 10, torch.randn(3, 4), sample]
    branches = lambda x: ((x > 0).all(), (ref.lin(x) * (2 if (x > 0).all() else 1)).abs().max() > 2.5)  # noqa: E731
    for x in calls:
        for m in (model, ref):
            m.zero_grad()
        fallbacks = model._tvm_dispatch.calls_fallback
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            got = model(x)
            got.sum().backward()
        want = ref(x)
        want.sum().backward()
        torch.testing.assert_close(got, want)
        for g, w in zip(_grads(model), _grads(ref)):
            torch.testing.assert_close(g, w)
        ran_pytorch = model._tvm_dispatch.calls_fallback > fallbacks
        assert ran_pytorch == (branches(x) != branches(sample)), x
    assert model._tvm_dispatch.calls_tvm + model._tvm_dispatch.calls_fallback == len(calls)


def test_a_loss_that_checks_its_input_compiles() -> None:
    """``F.gaussian_nll_loss`` checks ``torch.any(var < 0)`` on every call; a negative variance
    later raises PyTorch's error."""
    torch.manual_seed(2)
    target = torch.rand(3, 4)
    module = add_tvm_dispatch(Fn(lambda x, var: F.gaussian_nll_loss(x, target, var)), (torch.randn(3, 4), target))
    x = torch.randn(3, 4, requires_grad=True)
    with strict_net():
        got = module(x, target + 0.5)
    torch.testing.assert_close(got, F.gaussian_nll_loss(x, target, target + 0.5))
    assert module._tvm_dispatch.calls_tvm == 1
    with warnings.catch_warnings(), pytest.raises(ValueError, match="var has negative entry"):
        warnings.simplefilter("ignore", FallbackWarning)
        module(x, target - 2)


def test_sampling_the_branch_draws_nothing_and_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The retrace runs the forward's real ops (a dropout, ``torch.rand``): the user's generator
    stays where it was, and torch's per-branch warnings are not the user's to read."""

    def noisy(x: torch.Tensor) -> torch.Tensor:
        y = F.dropout(x, 0.5) + torch.rand(x.shape)
        return y * 2 if x.sum() > 0 else y

    torch.manual_seed(3)
    sample = torch.rand(3, 4)
    before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING):
        add_tvm_dispatch(Fn(noisy), (sample,))
    assert torch.equal(torch.get_rng_state(), before)
    assert not [r for r in caplog.records if "propagate_real_tensors" in r.getMessage()]
    assert not [r for r in caplog.records if "Unable to find user code" in r.getMessage()]


def test_a_branch_on_a_random_draw_is_still_refused() -> None:
    """LayerDrop decided once while tracing would hold for good."""

    def layer_drop(x: torch.Tensor) -> torch.Tensor:
        return x if torch.rand([]) < 0.3 else x * 2

    with pytest.raises(ConversionError, match="branches on a tensor's values"):
        add_tvm_dispatch(Fn(layer_drop), (torch.randn(3, 4),))


def test_a_branch_on_a_float_read_is_refused_with_the_reason() -> None:
    """``x.max().item() > 2.5`` compares a Python float: torch writes no run-time assertion for it,
    so a program with the sample's branch would hold unguarded."""

    def float_branch(x: torch.Tensor) -> torch.Tensor:
        return x / 4 if x.abs().max().item() > 2.5 else x

    with pytest.raises(ConversionError, match="float value read from a tensor.*cannot be compiled as the sample"):
        add_tvm_dispatch(Fn(float_branch), (torch.randn(3, 4),))


def test_a_count_read_from_a_tensor_compiles_for_the_samples_count() -> None:
    """``n = int((x > 0).sum())`` sizing a slice: torch specializes the program to the sample's
    count and asserts it; another count runs PyTorch."""

    def sized(x: torch.Tensor) -> torch.Tensor:
        n = int((x > 0).sum())
        return x.flatten()[:n] * 2

    sample = torch.tensor([[1.0, -1.0, 2.0], [3.0, -2.0, 0.5]])
    module = add_tvm_dispatch(Fn(sized), (sample,))
    with strict_net():
        torch.testing.assert_close(module(sample * 3), sized(sample * 3))
    other = torch.tensor([[1.0, 1.0, 2.0], [3.0, -2.0, 0.5]])
    with pytest.warns(FallbackWarning, match="PyTorch ran the call"):
        torch.testing.assert_close(module(other), sized(other))
