"""A variant's two parts (``pipeline.parts``): the compile builds the part its first call needs
(training: forward and backward; inference: the no_grad forward), the other is built by the first
call that needs it, once, and each part's outputs are checked against PyTorch on its first call."""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from tvmbridge import VerificationWarning, add_tvm_dispatch
from tvmbridge.pipeline.parts import INFER, TRAIN


class Net(torch.nn.Module):
    def __init__(self, act: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.norm = torch.nn.BatchNorm1d(8)
        self.act = act if act is not None else torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.norm(self.a(x))))


def _compiled(m: torch.nn.Module):
    (variant,) = m._tvm_dispatch.variants
    return variant.compiled


def _train_step(m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    m.zero_grad(set_to_none=True)
    out = m(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_a_training_call_builds_the_training_part_only_until_a_no_grad_call() -> None:
    torch.manual_seed(0)
    eager = Net().train()
    tvm = add_tvm_dispatch(copy.deepcopy(eager))
    x = torch.randn(5, 6)
    got, want = _train_step(tvm, x), _train_step(eager, x)
    compiled = _compiled(tvm)
    assert compiled.first_part == TRAIN and compiled.parts.built(TRAIN) and not compiled.parts.built(INFER)
    torch.testing.assert_close(got[0], want[0])
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], msg=n)
    with torch.no_grad():
        got_infer, want_infer = tvm(x), eager(x)
    assert compiled.parts.built(INFER) and len(tvm._tvm_dispatch.variants) == 1
    torch.testing.assert_close(got_infer, want_infer)
    torch.testing.assert_close(tvm.norm.running_mean, eager.norm.running_mean)
    trust = tvm._tvm_dispatch.variants[0].trust
    assert trust.outputs and trust.gradients and trust.infer_outputs
    assert "train and infer parts" in tvm._tvm_dispatch.explain()


def test_a_no_grad_first_call_builds_the_inference_part_and_training_builds_later() -> None:
    torch.manual_seed(1)
    eager = Net().eval()
    tvm = add_tvm_dispatch(copy.deepcopy(eager))
    x = torch.randn(4, 6)
    with torch.no_grad():
        got, want = tvm(x), eager(x)
    compiled = _compiled(tvm)
    assert compiled.first_part == INFER and compiled.parts.built(INFER) and not compiled.parts.built(TRAIN)
    assert "infer part only" in tvm._tvm_dispatch.explain()
    torch.testing.assert_close(got, want)
    got_step, want_step = _train_step(tvm, x), _train_step(eager, x)  # eval mode, with gradients
    assert compiled.parts.built(TRAIN) and len(tvm._tvm_dispatch.variants) == 1
    torch.testing.assert_close(got_step[0], want_step[0])
    for n in want_step[1]:
        torch.testing.assert_close(got_step[1][n], want_step[1][n], msg=n)


def test_a_wrong_inference_part_is_caught_on_its_first_call() -> None:
    """The inference part is other kernels than the training part: its first call is checked
    even after the training part's were. Here it is built from another model's functions
    (GELU for ReLU): the call gets PyTorch's values, with a warning, and the variant goes."""
    torch.manual_seed(2)
    eager = Net().train()
    tvm = add_tvm_dispatch(copy.deepcopy(eager))
    other = add_tvm_dispatch(Net(torch.nn.GELU()).train())
    x = torch.randn(5, 6)
    _train_step(tvm, x), _train_step(eager, x), _train_step(other, x)
    compiled = _compiled(tvm)
    compiled.parts._halves = _compiled(other).parts._halves  # noqa: SLF001 - a wrong part on purpose
    with torch.no_grad(), pytest.warns(VerificationWarning, match="its outputs disagreed with PyTorch's"):
        got = tvm(x)
    with torch.no_grad():
        torch.testing.assert_close(got, eager(x))
    assert not tvm._tvm_dispatch.variants


def test_two_threads_needing_the_inference_part_build_it_once() -> None:
    torch.manual_seed(3)
    eager = Net().train()
    tvm = add_tvm_dispatch(copy.deepcopy(eager))
    x = torch.randn(5, 6)
    _train_step(tvm, x), _train_step(eager, x)
    parts = _compiled(tvm).parts
    builds: list[str] = []
    build = parts._build  # noqa: SLF001 - counted

    def counted(module, key):
        builds.append(key)
        return build(module, key)

    parts._build = counted  # noqa: SLF001
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            with torch.no_grad():
                results.append(tvm(x))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(builds) == 1 and len(results) == 3
    with torch.no_grad():
        want = eager(x)
    for r in results:
        torch.testing.assert_close(r, want)
