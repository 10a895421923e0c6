"""Everyday training code against PyTorch: keyword calls, the forward's signature, results that
must not share memory, parameters a call does not use.

Each case runs with ``verify=False``: the first-call safety net would hide the defect, and these
must be right without it.
"""
from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

from tvmbridge import add_tvm_dispatch


class Tagger(torch.nn.Module):
    """A text model's call: same-shape ids and mask, an optional third input of another rank."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.types = torch.nn.Embedding(2, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> tuple:
        """Logits, and the loss when labels are given."""
        h = self.emb(input_ids)
        if token_type_ids is not None:
            h = h + self.types(token_type_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.out(h).mean(1)
        if labels is None:
            return (logits,)
        return torch.nn.functional.cross_entropy(logits, labels), logits


def _batch(b: int, s: int, seed: int, types: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {"attention_mask": torch.ones(b, s, dtype=torch.long), "labels": torch.randint(0, 3, (b,), generator=g),
             "input_ids": torch.randint(0, 50, (b, s), generator=g)}  # not in signature order
    batch["attention_mask"][0, s // 2:] = 0
    if types:
        batch["token_type_ids"] = torch.randint(0, 2, (b, s), generator=g)
    return batch


def _grads(m: torch.nn.Module) -> dict:
    return {n: p.grad for n, p in m.named_parameters()}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for n in want:
        if want[n] is None:
            assert got[n] is None, n
        else:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("sample", [False, True], ids=["no-sample", "sample"])
def test_keyword_calls_bind_as_pytorch_binds_them(sample: bool) -> None:
    torch.manual_seed(0)
    eager = Tagger()
    tvm = copy.deepcopy(eager)
    first = _batch(2, 6, 1)
    add_tvm_dispatch(tvm, sample_kwargs=first if sample else None, verify=False)
    # the first batch, another length (a second variant), then a keyword of another rank
    for batch in (first, _batch(3, 9, 2), _batch(2, 6, 3, types=True)):
        for m in (eager, tvm):
            m.zero_grad(set_to_none=True)
            loss, _ = m(**batch)
            loss.backward()
        torch.testing.assert_close(tvm(**batch)[1], eager(**batch)[1], rtol=1e-5, atol=1e-6)
        _assert_same(_grads(tvm), _grads(eager))
    assert len(tvm._tvm_dispatch.variants) >= 2


def test_dispatched_forward_keeps_the_signature() -> None:
    m = Tagger()
    want = inspect.signature(m.forward)
    add_tvm_dispatch(m, verify=False)
    assert inspect.signature(m.forward) == want
    assert m.forward.__name__ == "forward" and m.forward.__doc__ == Tagger.forward.__doc__
    m.remove_tvm_dispatch()
    assert inspect.signature(m.forward) == want


class Parallel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


class Cell(torch.nn.Module):
    """An RNN-style cell: two biases added to one sum get equal gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.wi, self.wh = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4))
        self.bi, self.bh = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.wi + self.bi + h @ self.wh + self.bh)


class Positional(torch.nn.Module):
    """``pos``'s gradient is the output gradient itself; ``unused`` takes no part in the call."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(2, 4))
        self.unused = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos


@pytest.mark.parametrize("make,inputs", [
    (Parallel, lambda: (torch.randn(2, 4),)),
    (Cell, lambda: (torch.randn(2, 4), torch.randn(2, 4))),
], ids=["parallel-linears", "rnn-cell"])
def test_gradients_never_share_memory(make, inputs) -> None:
    """Accumulation over two backwards and clipping: a shared buffer would be scaled twice."""
    torch.manual_seed(0)
    eager = make()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    args = inputs()
    for m in (eager, tvm):
        for _ in range(2):
            m(*args).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
    ptrs = [p.grad.data_ptr() for p in tvm.parameters()]
    assert len(set(ptrs)) == len(ptrs)
    _assert_same(_grads(tvm), _grads(eager))


def test_gradient_is_not_the_callers_output_gradient_and_unused_stays_none() -> None:
    torch.manual_seed(0)
    eager = Positional()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    x = torch.randn(2, 4)
    g = torch.randn(2, 4)
    g_before = g.clone()
    out = tvm(x)
    out.backward(g, retain_graph=True)
    assert tvm.pos.grad.data_ptr() != g.data_ptr()
    out.backward(g)  # accumulates into .grad in place: must not change the caller's g
    torch.testing.assert_close(g, g_before, rtol=0, atol=0)
    torch.testing.assert_close(tvm.pos.grad, 2 * g)
    assert tvm.unused.grad is None  # as in PyTorch: AdamW must not decay it
    opt = torch.optim.AdamW(tvm.parameters(), lr=0.1, weight_decay=0.5)
    before = tvm.unused.detach().clone()
    opt.step()
    torch.testing.assert_close(tvm.unused.detach(), before, rtol=0, atol=0)


class Four(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.lin(x)
        return h, h + 0, h * 1, h.clone()


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_outputs_never_share_memory(grad: bool) -> None:
    m = add_tvm_dispatch(Four(), verify=False)
    with torch.set_grad_enabled(grad):
        outs = m(torch.randn(2, 4))
    assert len({o.data_ptr() for o in outs}) == 4
    with torch.no_grad():
        outs[1].add_(1)
    torch.testing.assert_close(outs[0] + 1, outs[1])
    torch.testing.assert_close(outs[0], outs[3])


def test_a_float64_batch_into_a_float32_model_raises_as_pytorch_does() -> None:
    m = add_tvm_dispatch(torch.nn.Linear(6, 3), verify=False)
    m(torch.randn(5, 6))
    with pytest.warns(UserWarning, match="PyTorch refuses"), pytest.raises(RuntimeError, match="dtype"):
        m(torch.randn(5, 6, dtype=torch.float64))  # the compile refuses it, PyTorch raises its own error


@pytest.mark.parametrize("bad", [
    torch.randn(5, 6, dtype=torch.float64),  # a float64 batch: PyTorch refuses the matmul
    torch.randn(5, 7),  # the wrong width
    torch.randint(0, 3, (5, 6)),  # integer features
], ids=["float64", "width", "integers"])
def test_a_bad_first_call_raises_pytorchs_own_error(bad: torch.Tensor) -> None:
    """No variant yet and fallback off: the bridge's trace fails too, but the error the user sees
    is PyTorch's (what the call would raise without the bridge), noting the bridge's."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    ref = copy.deepcopy(model)
    with pytest.raises(RuntimeError) as want:
        ref(bad)
    m = add_tvm_dispatch(model)
    with pytest.raises(type(want.value)) as got:
        m(bad)
    assert str(got.value) == str(want.value)
    assert any("tvmbridge: compiling" in note for note in getattr(got.value, "__notes__", []))
    good = torch.randn(5, 6)
    torch.testing.assert_close(m(good), ref(good))  # a good batch after it compiles
    assert m._tvm_dispatch.log.calls_tvm == 1


class _Unconvertible(torch.nn.Module):
    """PyTorch runs it; the bridge has no converter for ``i1e``; the batch norm's statistics and the
    dropout's draw are what the probe must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.i1e(torch.nn.functional.dropout(self.bn(self.fc(x)), 0.5))


def test_a_call_pytorch_runs_but_the_bridge_cannot_still_says_why_and_changes_nothing() -> None:
    from tvmbridge.errors import ConversionError

    m = add_tvm_dispatch(_Unconvertible().train())
    stats = [b.clone() for b in m.buffers()]
    torch.manual_seed(3)
    with pytest.raises(ConversionError, match="i1e"):
        m(torch.randn(5, 6))
    after = torch.rand(3)
    torch.manual_seed(3)
    torch.randn(5, 6)
    assert torch.equal(after, torch.rand(3))  # the probe drew nothing the caller sees
    for b, before in zip(m.buffers(), stats):
        assert torch.equal(b, before)


class DropPath(torch.nn.Module):
    """Stochastic depth as timm/ConvNext write it: ``rand`` sized by the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape[0], 1, 1, dtype=x.dtype, device=x.device) >= 0.3
        return x + self.lin(x) * keep / 0.7


def test_random_ops_sized_by_the_call_at_every_shape() -> None:
    """A random op's size argument replays at each call's sizes (symbolic variants included)."""
    torch.manual_seed(0)
    eager = DropPath()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    for b, s in ((2, 5), (3, 5), (4, 7), (5, 9)):
        x = torch.randn(b, s, 8)
        got, want = [], []
        for m, out in ((tvm, got), (eager, want)):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(b)
            y = m(x)
            y.pow(2).sum().backward()
            out += [y.detach(), m.lin.weight.grad]
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert any(v.symbolic for v in tvm._tvm_dispatch.variants)


class IntegerMath(torch.nn.Module):
    """PyTorch's promotions: ``log`` of an integer tensor, a bool mask times floats, ``int // 2``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        scale = torch.log(pos + 1) * (pos > 2)
        return self.lin(x) * scale.unsqueeze(-1) + (pos // 2).unsqueeze(-1) / 3 + pos.clamp(1, 2).unsqueeze(-1)


def test_integer_inputs_promote_as_pytorch_promotes_them() -> None:
    torch.manual_seed(0)
    eager = IntegerMath()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    x, pos = torch.randn(5, 4), torch.arange(5)
    got, want = tvm(x, pos), eager(x, pos)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(got, want)
    _assert_same(_grads(tvm), _grads(eager))


class MaskedSelect(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[mask].sum()


class RoutedByWhere(torch.nn.Module):
    """Mixture-of-experts routing as users write it: rows picked by ``torch.where(top_k == e)``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = torch.nn.Linear(4, 3), torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, chosen = self.gate(x).softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, k = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(x[rows]) * weight[rows, k, None])
        return out


class PackedLSTM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 6, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return self.rnn(packed)[1][0]


def cumulative_batch_norm() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=None))


class BagOfWords(torch.nn.Module):
    """A recommender's table: its gradient a sparse tensor (or scaled by each index's count)."""

    def __init__(self, **embedding: bool) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(20, 4, **embedding)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).mean(1))


@pytest.mark.parametrize("make,inputs,message", [
    (lambda: BagOfWords(sparse=True), (torch.tensor([[1, 2, 2], [4, 5, 1]]),), r"sparse=True .*fallback=True"),
    (lambda: BagOfWords(scale_grad_by_freq=True), (torch.tensor([[1, 2, 2]]),), "scale_grad_by_freq=True"),
    (MaskedSelect, (torch.randn(5, 4), torch.tensor([True, False, True, True, False])), "depends on the values"),
    (RoutedByWhere, (torch.randn(5, 4),), "depends on the values.*torch.compile"),
    (cumulative_batch_norm, (torch.randn(3, 4),), r"momentum=None \(1\) reads num_batches_tracked"),
    (PackedLSTM, (torch.randn(3, 5, 4), torch.tensor([5, 3, 2])), "pack_padded_sequence takes its sizes"),
], ids=["sparse-embedding", "embedding-scaled-by-frequency", "boolean-mask-indexing", "experts-routed-by-where", "batch-norm-cumulative", "packed-sequence"])
def test_what_cannot_compile_is_refused_with_what_to_do(make, inputs, message: str) -> None:
    from tvmbridge.errors import ConversionError

    with pytest.raises(ConversionError, match=message):
        add_tvm_dispatch(make().train(), inputs)
    m = add_tvm_dispatch(make().train(), fallback=True)  # or PyTorch keeps running it, with a warning
    with pytest.warns(UserWarning, match=message):
        out = m(*inputs)
    assert out.requires_grad
    out.sum().backward()  # PyTorch's gradients, of PyTorch's kind
    if isinstance(m, BagOfWords) and m.table.sparse:
        assert m.table.weight.grad.is_sparse


class SharedTable(torch.nn.Module):
    """DeBERTa's pattern: one embedding table read in every layer with the same indices (one
    index-range flag, returned once per read), and an integer output returned twice."""

    def __init__(self) -> None:
        super().__init__()
        self.rel = torch.nn.Embedding(8, 4, dtype=torch.float64)
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = x
        for _ in range(3):
            h = self.lin(h) + self.rel(pos)
        top = h.argmax(-1)
        return h.tanh().sum(), top, top


def test_repeated_non_differentiable_outputs_train() -> None:
    torch.manual_seed(0)
    eager = SharedTable()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), fallback=False)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    pos = torch.randint(0, 8, (2, 5))
    got, want = tvm(x, pos), eager(x, pos)
    got[0].backward()
    want[0].backward()
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    for (name, p), q in zip(eager.named_parameters(), tvm.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)


class ConstantOutput(torch.nn.Module):
    """A tensor made from nothing in the output (Mistral's cache holds ``torch.tensor(window)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.lin(x).tanh().sum(), torch.tensor(4096), torch.tensor(4096)


def test_an_output_made_from_nothing_trains() -> None:
    torch.manual_seed(0)
    eager = ConstantOutput()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), fallback=False)
    x = torch.randn(3, 4, dtype=torch.float64)
    got, want = tvm(x), eager(x)
    got[0].backward()
    want[0].backward()
    assert torch.equal(got[1], want[1]) and got[1].dtype == want[1].dtype and torch.equal(got[2], want[2])
    got[1].add_(1)  # the user's tensor: the next call's is its own
    assert tvm(x)[1].item() == 4096
    torch.testing.assert_close(tvm.lin.weight.grad, eager.lin.weight.grad, rtol=1e-12, atol=1e-12)


class DropoutOnExpanded(torch.nn.Module):
    """XLNet's pattern: dropout applied to a tensor expanded along the batch (stride 0): eager
    draws its noise as ``empty_like(input)``, a contiguous tensor, and so must the bridge."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(5, 1, 8))
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.drop(self.pos.expand(-1, x.shape[1], -1))).pow(2).sum()


def test_dropout_on_an_expanded_tensor_draws_eagers_mask() -> None:
    torch.manual_seed(0)
    eager = DropoutOnExpanded()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False, fallback=False)
    x = torch.randn(5, 3, 8)
    torch.manual_seed(7)
    got = tvm(x)
    torch.manual_seed(7)
    want = eager(x)
    got.backward()
    want.backward()
    assert tvm._tvm_dispatch.calls_fallback == 0 and tvm._tvm_dispatch.variants, tvm._tvm_dispatch.explain()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(tvm.pos.grad, eager.pos.grad)


class StopsGradients(torch.nn.Module):
    """Targets built from the model's own values: a ``detach()``, a ``torch.no_grad()`` block, and a
    buffer the forward writes (a running average that is its input, not a buffer of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        with torch.no_grad():
            target = torch.tanh(y) * 2
        average.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return ((y - target) ** 2).sum() + (y * y.detach()).sum() + (y * average).sum()


def test_detach_and_no_grad_blocks_stop_the_gradient_and_written_inputs_are_written() -> None:
    """Export keeps ``detach`` only as an alias after its decompositions, and a no_grad block only as
    an op its decompositions inline: both lost, the gradient flowed through the target (twice the
    gradient of ``y * y.detach()``)."""
    torch.manual_seed(0)
    eager = StopsGradients()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False, fallback=False)
    x = torch.randn(4, 6)
    averages = [torch.zeros(6), torch.zeros(6)]
    for _ in range(2):
        got, want = tvm(x, averages[0]), eager(x, averages[1])
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(averages[0], averages[1])
    assert tvm._tvm_dispatch.calls_fallback == 0, tvm._tvm_dispatch.explain()
    for p, q in zip(tvm.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):  # as PyTorch refuses it
        tvm(x, torch.zeros(6, requires_grad=True))


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant)
        with torch.no_grad():
            scale = h.abs().mean()
        return (self.b(h) * scale).square().sum()


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_and_a_no_grad_block_compiled_under_no_grad(reentrant: bool) -> None:
    """Reentrant checkpointing (transformers' default) runs its function under no_grad: traced as
    is, that read as a no_grad block and every gradient inside it was lost. And a variant first
    compiled under no_grad (export marks a no_grad block only where it differs from the mode it
    traces under) must still stop the gradient at the block when a later call trains."""
    torch.manual_seed(0)
    eager = Checkpointed(reentrant)
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False, fallback=False)
    x = torch.randn(3, 6, requires_grad=True)
    with torch.no_grad():
        torch.testing.assert_close(tvm(x), eager(x))
    got, want = tvm(x), eager(x)
    assert len(tvm._tvm_dispatch.variants) == 1, tvm._tvm_dispatch.explain()
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    for p, q in zip(tvm.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class MaskedWrite(torch.nn.Module):
    """``x[mask] = v`` with a learned vector where a boolean mask marks positions (wav2vec2's
    masked time steps), and the accumulating form."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.fill = torch.nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h[mask] = self.fill
        return h.clone().index_put_((~mask,), self.fill * 2, accumulate=True)


def test_boolean_mask_writes_train_as_eager() -> None:
    torch.manual_seed(0)
    m = MaskedWrite()
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m, verify=False)
    for b in (2, 3, 3):
        x, mask = torch.randn(b, 5, 6), torch.rand(b, 5) > 0.5
        for model in (m, ref):
            model.zero_grad()
            (model(x, mask) * torch.linspace(-1, 1, 6)).sum().backward()
        _assert_same(_grads(m), _grads(ref))
    assert m._tvm_dispatch.calls_tvm == 3


class SharedEncoding(torch.nn.Module):
    """One submodule registered under two paths (timm's CoaT shares a position encoding between
    its blocks), and a tied weight, with a BatchNorm so that buffers are swapped as well."""

    def __init__(self) -> None:
        super().__init__()
        self.encoding = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        self.blocks = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
        for block in self.blocks:
            block.encoding = self.encoding
        self.head = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8, bias=False)
        self.out.weight = self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block.encoding(x)
        return self.out(torch.relu(self.head(x)))


def test_a_submodule_registered_twice_keeps_its_own_tensors_and_trains() -> None:
    """The trace swaps the module's tensors for fake ones and back; torch's ``functional_call``
    put the fake ones back at a path registered twice, so the next call read fake parameters."""
    torch.manual_seed(0)
    model, x = SharedEncoding(), torch.randn(4, 8)
    ref = copy.deepcopy(model)
    before = {n: t for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    add_tvm_dispatch(model, (x,))
    after = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers()])
    assert all(after[n] is t for n, t in before.items()), [n for n, t in before.items() if after[n] is not t]
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x * (step + 1)).square().mean().backward()
            o.step()
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), n
    assert model.blocks[1].encoding[0].weight is model.encoding[0].weight


@pytest.mark.parametrize(
    "like",
    [torch.zeros_like, torch.ones_like, lambda x: torch.full_like(x, 3.0), lambda x: x.new_zeros(x.shape)],
    ids=["zeros_like", "ones_like", "full_like", "new_zeros"],
)
def test_an_input_read_only_for_its_shape_keeps_grad_none(like) -> None:
    """``zeros_like(x) + y``: PyTorch gives ``x`` no gradient; the compiled backward handed back
    zeros, and the first-call check discarded the variant (PyTorch ran every call after)."""
    from tvmbridge.errors import VerificationWarning

    class Mixed(torch.nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return like(x) * y + y

    x, y = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    module = add_tvm_dispatch(Mixed(), (x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", VerificationWarning)
        out = module(x, y)
        out.sum().backward()
    assert type(out.grad_fn).__name__ == "TVMFunctionBackward"
    assert x.grad is None and torch.equal(y.grad, like(x).detach() + 1)


def test_a_forward_that_branches_on_values_it_cannot_sample_is_refused_with_what_to_do():
    """torch.export's data-dependent guard error alone ("Could not guard on data-dependent
    expression Eq(u0, 1)") does not say what to change (a branch on a random draw cannot be
    compiled as the sample took it: ``test_value_branches``)."""
    from tests.helpers import Fn
    from tvmbridge import ConversionError

    with pytest.raises(ConversionError, match="branches on a tensor's values.*fallback=True"):
        add_tvm_dispatch(Fn(lambda x: x * 2 if torch.rand([]) > 0.5 else x), (torch.randn(3, 4),))


def test_a_cumulative_batch_norm_compiles_in_eval() -> None:
    model = cumulative_batch_norm()
    model(torch.randn(5, 4))  # running statistics of one batch
    model.eval()
    x = torch.randn(3, 4)
    want = model(x)
    add_tvm_dispatch(model, (x,))
    got = model(x)
    torch.testing.assert_close(got, want)
    assert model._tvm_dispatch.calls_tvm == 1


class Memory:
    """A user object the forward writes into (a list of what it saw)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []


class Remembers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, memory: Memory) -> torch.Tensor:
        y = self.fc(x)
        memory.seen.append(y.detach())
        return y * len(memory.seen)


def test_an_object_argument_runs_pytorch_and_is_never_written_by_a_trace() -> None:
    """An argument that is an object, not a value: compiled code would freeze it as the trace
    found it (``len(memory.seen)`` baked in as 1), the guard would pass the same object however
    it grew, and the trace would append its fake tensor to the caller's list."""
    from tvmbridge import ConversionError, FallbackWarning

    torch.manual_seed(0)
    m = Remembers()
    ref = copy.deepcopy(m)
    x = torch.randn(3, 4)
    with pytest.raises(ConversionError, match=r"memory is a Memory object.*pass its tensors"):
        add_tvm_dispatch(copy.deepcopy(m), (x, Memory()))
    add_tvm_dispatch(m)
    mine, theirs = Memory(), Memory()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(m(x, mine), ref(x, theirs))
    assert any(issubclass(w.category, FallbackWarning) and "Memory object" in str(w.message) for w in caught)
    assert len(mine.seen) == 3 and all(not isinstance(t, torch._subclasses.FakeTensor) for t in mine.seen)
    assert m._tvm_dispatch.calls_tvm == 0


class CastsItsRouter(torch.nn.Module):
    """Switch Transformers' router casts its classifier to the dtype it has, on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier, self.out = torch.nn.Linear(6, 4), torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(torch.float32)
        gate = self.classifier(x).softmax(-1).max(-1).values
        return self.out(x) * gate[:, None]


def test_a_cast_to_the_dtype_a_submodule_has_is_the_no_op_it_is_in_eager() -> None:
    """The trace failed on it ("_apply(): Couldn't swap Linear.weight")."""
    torch.manual_seed(0)
    model = CastsItsRouter()
    ref = copy.deepcopy(model)
    classifier = model.classifier
    add_tvm_dispatch(model)
    x = torch.randn(5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert model.classifier is classifier and model._tvm_dispatch.log.calls_tvm == 1
    assert torch.nn.Module.to is torch.nn.Module.__dict__["to"] and torch.nn.Module.to.__name__ == "to"
