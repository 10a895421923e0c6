"""Autograd set up inside a dispatched forward, which ``torch.export`` keeps no trace of: a
gradient hook on an intermediate tensor (gradient reversal or clipping by hook, Grad-CAM's
capture) and ``retain_grad``. Compiled, the hook would never run and ``.grad`` never fill; the
trace is refused with what to do, ``fallback=True`` trains as PyTorch, and every patch the
recording needs is undone after the trace. Hooks outside the module (on its output, its input)
run as in PyTorch on compiled calls."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from tvmbridge import ConversionError, VerificationWarning, add_tvm_dispatch


class ReversedByHook(nn.Module):
    def __init__(self, conditional: bool = False) -> None:
        super().__init__()
        self.conditional = conditional
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not self.conditional or h.requires_grad:
            h.register_hook(lambda g: -0.5 * g)
        return self.b(torch.tanh(h))


class KeepsFeatureGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.features: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.retain_grad()
        self.__dict__["features"] = h  # not an attribute write the trace refuses: the gradient is the point
        return self.b(torch.tanh(h))


def _grads(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    m.zero_grad(set_to_none=True)
    (m(x) * torch.linspace(-1, 1, 3)).sum().backward()
    return {n: p.grad for n, p in m.named_parameters()}


@pytest.mark.parametrize("make,called", [(ReversedByHook, "register_hook"), (KeepsFeatureGrad, "retain_grad")])
def test_gradient_handling_inside_forward_is_refused_and_its_fallback_runs_it(make, called: str) -> None:
    register_hook = torch.Tensor.__dict__["register_hook"]
    x = torch.randn(4, 6)
    with pytest.raises(ConversionError, match=rf"Tensor\.{called}.*outside the dispatched module.*fallback=True"):
        add_tvm_dispatch(make(), (x,))
    assert torch.Tensor.__dict__["register_hook"] is register_hook and "retain_grad" not in torch.Tensor.__dict__
    torch.manual_seed(0)
    m = make()
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m, fallback=True)
    with pytest.warns(UserWarning, match=called):
        got = _grads(m, x)
    want = _grads(ref, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    if isinstance(m, KeepsFeatureGrad):
        assert m.features is not None and m.features.grad is not None


def test_a_hook_behind_a_requires_grad_check_never_gives_a_wrong_gradient() -> None:
    """The trace sees the module's tensors detached, so ``if h.requires_grad`` skips the hook
    there and nothing is refused; the first-call check finds the difference, and that call and
    every later one get PyTorch's gradients (warned)."""
    torch.manual_seed(0)
    m = ReversedByHook(conditional=True)
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m)
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", VerificationWarning)
            got = _grads(m, x)
        want = _grads(ref, x)
        for name in want:
            torch.testing.assert_close(got[name], want[name])


def test_hooks_outside_the_module_run_on_compiled_calls() -> None:
    torch.manual_seed(0)
    m = ReversedByHook(conditional=True)
    m.forward = lambda x: m.b(torch.tanh(m.a(x)))  # type: ignore[method-assign]  # no hook inside
    ref = copy.deepcopy(m)
    ref.forward = lambda x: ref.b(torch.tanh(ref.a(x)))  # type: ignore[method-assign]
    add_tvm_dispatch(m)
    results = []
    for net in (m, ref):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()
        x.register_hook(lambda g: g * 2)
        out = net(x)
        out.register_hook(lambda g: -g)
        out.pow(2).sum().backward()
        results.append((x.grad, {n: p.grad for n, p in net.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0])
    for name in results[1][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name])
    assert m._tvm_dispatch.calls_tvm == 1 and m._tvm_dispatch.calls_fallback == 0
