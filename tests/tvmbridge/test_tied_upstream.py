"""A dispatched module whose parameter also made its input, before the call: an LM head tied to
the embedding that PyTorch runs (or another dispatched module runs), a block applied to its own
output. PyTorch's reference run (the first-call check, the differentiable backward) must count
only the call's own path to that parameter: autograd carries the input's gradient on to the
earlier use itself."""
from __future__ import annotations

import copy

import torch

from tvmbridge import add_tvm_dispatch

from ..helpers import strict_net as _strict


class TiedLM(torch.nn.Module):
    """PyTorch runs the embedding and the body; the head (dispatched alone) shares its weight."""

    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh())
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.embed(ids)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_a_head_tied_to_the_embedding_before_it_trains_as_eager() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    add_tvm_dispatch(model.head)  # the net on (the default): its check differentiates PyTorch's head
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    with _strict():
        for _ in range(3):
            ids, labels = torch.randint(0, 20, (2, 5)), torch.randint(0, 20, (2, 5))
            for m, opt in zip((model, ref), opts):
                opt.zero_grad()
                m(ids, labels).backward()
            torch.testing.assert_close(model.embed.weight.grad, ref.embed.weight.grad)
            torch.testing.assert_close(model.body[0].weight.grad, ref.body[0].weight.grad)
            for opt in opts:
                opt.step()
    log = model.head._tvm_dispatch.log
    assert log.calls_tvm == 3 and log.calls_fallback == 0


def test_a_block_applied_to_its_own_output_under_a_gradient_penalty() -> None:
    """create_graph=True differentiates PyTorch's forward of each call (``_eager_vjp``): the second
    call's input was made by the block's own weight."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
    ref = copy.deepcopy(block)
    add_tvm_dispatch(block, verify=False)
    grads = []
    for m in (block, ref):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = m(m(x))
        gx, *gw = torch.autograd.grad(y.pow(2).sum(), [x, *m.parameters()], create_graph=True)
        penalty = gx.pow(2).sum()
        grads.append([*gw, *torch.autograd.grad(penalty, list(m.parameters()))])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


class EmbedsLM(torch.nn.Module):
    """transformers' ``model(inputs_embeds=model.get_input_embeddings()(ids))``: the caller embeds
    (prompt tuning, adversarial training in embedding space) with the weight the tied head reads."""

    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.body = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, inputs_embeds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.body(inputs_embeds)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_inputs_embedded_by_the_callers_use_of_the_models_own_weight() -> None:
    torch.manual_seed(0)
    model = EmbedsLM()
    ref = copy.deepcopy(model)
    add_tvm_dispatch(model)
    with _strict():
        for _ in range(2):
            ids, labels = torch.randint(0, 20, (2, 5)), torch.randint(0, 20, (2, 5))
            for m in (model, ref):
                m.zero_grad()
                m(m.embed(ids), labels).backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda s, n=name: f"{n}: {s}")
    assert model._tvm_dispatch.log.calls_tvm == 2
