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


@pytest.mark.parametrize("sample", [True, False], ids=["sample", "first-call"])
def test_hooks_on_the_dispatched_module_itself_run_once_per_call_as_in_pytorch(sample: bool) -> None:
    """The module's own hooks run around each dispatched call, never in the trace: traced, an
    output hook's change was compiled in and applied twice, a pre-hook ran without the call's
    arguments, and a recording hook kept a fake tensor."""
    import copy

    from tests.helpers import is_tvm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    records: dict[int, list] = {id(model): [], id(ref): []}
    backward_calls = {id(model): 0, id(ref): 0}
    for m in (model, ref):
        m.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
        m.register_forward_hook(lambda mod, args, out: out * 2)
        m.register_forward_hook(lambda mod, args, out: records[id(mod)].append(out.detach()))

        def count(mod, grad_in, grad_out) -> None:
            backward_calls[id(mod)] += 1

        m.register_full_backward_hook(count)
    x = torch.randn(5, 4, requires_grad=True)
    add_tvm_dispatch(model, (x,) if sample else None)
    for step in range(2):
        xi = (x * (step + 1)).detach().requires_grad_()
        xr = xi.detach().clone().requires_grad_()
        got, want = model(xi), ref(xr)
        assert model._tvm_dispatch.calls_tvm == step + 1
        torch.testing.assert_close(got, want)
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        torch.testing.assert_close(xi.grad, xr.grad)
    assert not is_tvm(got)  # the output hook's product is PyTorch's, on the compiled output
    assert len(records[id(model)]) == len(records[id(ref)]) == 2
    assert all(type(r) is torch.Tensor for r in records[id(model)])
    assert backward_calls[id(model)] == backward_calls[id(ref)] == 2
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
