"""Which submodule hooks compiled code may leave to the trace: read off the hook's own code."""
from __future__ import annotations

import pytest
import torch

from tvmbridge import ConversionError, add_tvm_dispatch
from tvmbridge.frontend.module_hooks import marks_output_for_grad

SEEN: list = []


def make_inputs_require_grads(module, input, output):  # transformers' and PEFT's, verbatim
    output.requires_grad_(True)


def with_kwargs(module, args, kwargs, output):
    output.requires_grad_()


def marks_the_module(module, input, output):
    module.requires_grad_(True)  # the module's parameters: state, not the call's autograd


def keeps_the_output(module, input, output):
    SEEN.append(output)


def marks_and_keeps(module, input, output):
    output.requires_grad_(True)
    SEEN.append(output)


def marks_a_global(module, input, output):
    SEEN[0].requires_grad_(True)


def test_a_hook_that_only_marks_its_output_is_recognized_and_no_other() -> None:
    assert marks_output_for_grad(make_inputs_require_grads)
    assert marks_output_for_grad(with_kwargs)
    assert marks_output_for_grad(lambda m, i, o: o.requires_grad_(True))
    for hook in (marks_the_module, keeps_the_output, marks_and_keeps, marks_a_global, print, len):
        assert not marks_output_for_grad(hook), hook
    counter = []
    assert not marks_output_for_grad(lambda m, i, o: counter.append(1) or o.requires_grad_(True))
    assert not marks_output_for_grad(lambda m, i, o: (o * 2).requires_grad_(True) and o)  # not plain loads


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(ids)).sum(1)


def test_a_frozen_embedding_marked_by_its_hook_compiles_with_eager_s_gradients() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (3, 4))
    eager, model = Net(), Net()
    model.load_state_dict(eager.state_dict())
    for m in (eager, model):
        m.embed.weight.requires_grad_(False)
        m.embed.register_forward_hook(make_inputs_require_grads)
    add_tvm_dispatch(model, (ids,))
    for m in (model, eager):
        m(ids).square().sum().backward()
    assert model._tvm_dispatch.calls_tvm == 1
    torch.testing.assert_close(model.fc.weight.grad, eager.fc.weight.grad)
    assert model.embed.weight.grad is None


@pytest.mark.parametrize("hook", [marks_the_module, marks_and_keeps])
def test_a_hook_that_does_more_is_still_refused(hook) -> None:
    model = Net()
    model.embed.register_forward_hook(hook)
    with pytest.raises(ConversionError, match=r"hooks on Net's submodules \(embed: 1 forward hook\)"):
        add_tvm_dispatch(model, (torch.randint(0, 10, (3, 4)),))
