"""Slicing and ranges against PyTorch over a grid: stepped slices (Swin's patch merging), their
gradients (float64, to 1e-12), and slices/ranges sized by a symbolic length (position ids cut to
the input's length, ``arange(seq)``) in one variant for every length."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tvmbridge import add_tvm_dispatch

STARTS = (None, 0, 1, 2, -3)
STOPS = (None, -1, 5)
STEPS = (1, 2, 3, 4)


class ManySlices(torch.nn.Module):
    """Every (start, stop, step) of the grid along axis 1, each weighted and summed."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, size, 4, dtype=torch.float64))
        self.cases = [c for c in itertools.product(STARTS, STOPS, STEPS)
                      if torch.empty(size)[slice(*c)].numel() > 0]  # empty slices run PyTorch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w
        total = y.new_zeros(())
        for k, case in enumerate(self.cases):
            part = y[:, slice(*case)]
            total = total + (part * (k + 1)).pow(2).sum() + part[::2, :, 1::2].sum()
        return total


# 7 and 8 (the odd/even split of a larger size, ~30 s each on 2 cores) are in the slow run
@pytest.mark.parametrize("size", [1, 2, pytest.param(7, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_stepped_slices_and_their_gradients(size: int) -> None:
    torch.manual_seed(size)
    eager = ManySlices(size)
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    x = torch.randn(3, size, 4, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    got, want = tvm(x), eager(x2)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tvm.w.grad, eager.w.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)


class Positions(torch.nn.Module):
    """HF's pattern: a position buffer cut to the input's length, a mask built from ``arange``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(32).unsqueeze(0), persistent=False)
        self.pos = torch.nn.Embedding(32, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        h = x + self.pos(self.position_ids[:, :seq])
        causal = torch.arange(seq)[None, :] <= torch.arange(seq)[:, None]
        scores = (self.lin(h) @ h.transpose(1, 2)).masked_fill(~causal[:, :seq], -1e4)
        return scores.softmax(-1)[..., :seq] @ h


def _close_to_scale(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, name: str) -> None:
    """Every element within ``atol + rtol * max|want|``: float32 sums round relative to the sizes
    they add up, not to each result (on an AVX2 Zen 3 both eager's and the bridge's embedding
    gradient at length 13 are 3e-5..4e-5 from float64, elementwise 1e-4 of entries near zero)."""
    worst = (got - want).abs().max().item()
    bound = atol + rtol * want.abs().max().item()
    assert worst <= bound, f"{name}: max abs error {worst:.3g} > {bound:.3g}"


def _same_as_eager_in_one_symbolic_variant(eager: torch.nn.Module, calls: list[torch.Tensor], rtol: float,
                                           atol: float, grad_rtol: float, loss=lambda out: out) -> None:
    """At every call: the loss, the input's gradient (where it has one) and every parameter's
    gradient equal eager's; the second shape compiled one symbolic variant that served the rest."""
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    for x in calls:
        x2 = x.detach().clone().requires_grad_() if x.requires_grad else x
        for m in (tvm, eager):
            m.zero_grad(set_to_none=True)
        got, want = loss(tvm(x)), loss(eager(x2))
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        if x.requires_grad:
            _close_to_scale(x.grad, x2.grad, grad_rtol, atol, "input")
        for (name, p), q in zip(tvm.named_parameters(), eager.parameters()):
            _close_to_scale(p.grad, q.grad, grad_rtol, atol, name)
    variants = tvm._tvm_dispatch.variants
    assert len(variants) == 2 and variants[1].symbolic, tvm._tvm_dispatch.explain()


def test_symbolic_slices_and_ranges_serve_every_length() -> None:
    torch.manual_seed(0)
    calls = [torch.randn(2, seq, 8) for seq in (6, 9, 13, 4)]
    _same_as_eager_in_one_symbolic_variant(Positions(), calls, rtol=1e-5, atol=1e-5, grad_rtol=1e-4,
                                           loss=lambda out: out.pow(2).sum())


class LastPositions(Positions):
    """XLM's pattern: the positions cut to the length, then the last ``seq`` of them taken
    (``x[:, -seq:]``, a start that is a symbolic negative size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        ids = self.position_ids[:, :seq][:, -seq:]
        return self.lin(x + self.pos(ids))


def test_a_slice_from_a_symbolic_negative_start_keeps_its_length() -> None:
    """The default converter clamped ``-seq`` into an extent Relax could not prove equal to
    ``seq``: the sum with the input had no shape, its gradient failed, and every new length
    compiled an exact variant."""
    torch.manual_seed(0)
    calls = [torch.randn(2, seq, 8) for seq in (6, 9, 13)]
    _same_as_eager_in_one_symbolic_variant(LastPositions(), calls, rtol=1e-5, atol=1e-5, grad_rtol=1e-4,
                                           loss=lambda out: out.pow(2).sum())


class PartialRotary(torch.nn.Module):
    """Phi-3's pattern: ``x[..., :rot]`` rotated, ``x[..., rot:]`` passed through and concatenated
    back; with ``rot`` the whole head the pass-through part is empty along the axis."""

    def __init__(self, rot: int) -> None:
        super().__init__()
        self.rot = rot
        self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        rotated, passed = h[..., :self.rot], h[..., self.rot:]
        half = self.rot // 2
        rotated = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1) * 0.5 + rotated
        return torch.cat((rotated, passed), dim=-1).pow(2).sum()


@pytest.mark.parametrize("rot", [8, 4])
def test_empty_cat_parts_are_dropped_not_refused(rot: int) -> None:
    torch.manual_seed(rot)
    eager = PartialRotary(rot)
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False, fallback=False)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    got, want = tvm(x), eager(x2)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tvm.lin.weight.grad, eager.lin.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)


class SliceAssign(torch.nn.Module):
    """``out[:, start:stop] = src`` (``slice_scatter``) on floats: both sides get gradients."""

    def __init__(self, start: int | None, stop: int | None) -> None:
        super().__init__()
        self.start, self.stop = start, stop
        self.lin = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        out = self.lin(x).clone()
        out[:, self.start:self.stop] = src * 3.0
        return (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sin().sum()


@pytest.mark.parametrize("start,stop", [(0, None), (1, None), (2, 5), (None, 3), (-2, None), (1, -1), (0, 7)])
def test_slice_assignment_and_its_gradients(start: int | None, stop: int | None) -> None:
    torch.manual_seed(0)
    eager = SliceAssign(start, stop)
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False, fallback=False)
    x = torch.randn(2, 7, 4, dtype=torch.float64, requires_grad=True)
    width = len(range(7)[slice(start, stop)])
    src = torch.randn(2, width, 4, dtype=torch.float64, requires_grad=True)
    x2, src2 = (t.detach().clone().requires_grad_() for t in (x, src))
    got, want = tvm(x, src), eager(x2, src2)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in ((x.grad, x2.grad), (src.grad, src2.grad), (tvm.lin.weight.grad, eager.lin.weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class ShiftRightDecoder(torch.nn.Module):
    """BART's decoder inputs: labels shifted right by slice assignment on integer ids at the
    call's length, a causal mask from ``full``/``triu``, attention over it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 2
        h = self.emb(shifted)
        seq = labels.shape[1]
        mask = torch.full((seq, seq), float("-inf")).triu(1)
        scores = self.q(h) @ self.k(h).transpose(1, 2) + mask
        return (scores.softmax(-1) @ h).pow(2).mean()


def test_shifted_decoder_inputs_serve_every_length_in_one_symbolic_variant() -> None:
    torch.manual_seed(0)
    calls = [torch.randint(0, 16, (2, seq)) for seq in (6, 9, 13, 4)]
    _same_as_eager_in_one_symbolic_variant(ShiftRightDecoder(), calls, rtol=1e-5, atol=1e-6, grad_rtol=1e-4)


class WindowAndRepeat(torch.nn.Module):
    """Slices along a symbolic axis (the last ``window`` positions, all but the first two) and a
    ``repeat`` whose count is the batch size (DeBERTa's relative positions per batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        tail, rest = h[:, -3:], h[:, 2:]
        repeated = h[:1, :1].repeat(x.shape[0], 2, 1)
        return tail.pow(2).sum() + rest.sin().sum() + (repeated * x[:, :2]).cos().sum()


def test_symbolic_axis_slices_and_repeats_have_gradients() -> None:
    torch.manual_seed(0)
    calls = [torch.randn(b, n, 8, dtype=torch.float64, requires_grad=True) for b, n in ((2, 6), (3, 9), (2, 13), (4, 5))]
    _same_as_eager_in_one_symbolic_variant(WindowAndRepeat(), calls, rtol=1e-12, atol=1e-12, grad_rtol=1e-12)


class LastTokenFirst(torch.nn.Module):
    """mBART's ``shift_tokens_right``: each row's last real token moved to the front, found by a
    ``gather`` whose (batch, 1) result is squeezed with both axes listed."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 4)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = ids.clone()
        last = (out.ne(1).sum(dim=1) - 1).unsqueeze(-1)
        start = out.gather(1, last).squeeze()
        out[:, 1:] = out[:, :-1].clone()
        out[:, 0] = start
        return self.emb(out), out


def test_squeeze_keeps_a_symbolic_batch_axis() -> None:
    torch.manual_seed(0)
    eager = LastTokenFirst()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False, fallback=False)
    for batch, seq in ((2, 5), (3, 4), (4, 7)):
        ids = torch.randint(2, 64, (batch, seq))
        ids[-1, -1] = 1  # padding: that row's last real token is one earlier
        with torch.no_grad():
            (got, got_ids), (want, want_ids) = tvm(ids), eager(ids)
        assert torch.equal(got_ids, want_ids), (got_ids, want_ids)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert tvm._tvm_dispatch.variants[-1].symbolic, tvm._tvm_dispatch.explain()


class InterleavedRotary(torch.nn.Module):
    """RoFormer's and GPT-J's rotary embedding (``x[..., ::2]``, ``x[..., 1::2]`` rotated and
    interleaved back) and Swin's patch merging (``x[:, 0::2, 1::2]``): stepped slices along
    static axes of a tensor whose batch and length are symbolic."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        even, odd = h[..., ::2], h[..., 1::2]
        rotated = torch.stack((-odd * 0.6 + even * 0.8, even * 0.6 + odd * 0.8), dim=-1).flatten(-2)
        grid = h.reshape(h.shape[0], -1, 4, 2)  # (batch, seq, 4, 2)
        merged = torch.cat((grid[:, :, 0::2, 0], grid[:, :, 1::2, 1], grid[:, :, 1::3, 1]), dim=-1)
        return rotated.pow(2).sum() + merged.sin().sum()


def test_stepped_slices_over_symbolic_sizes_serve_every_shape_in_one_variant() -> None:
    torch.manual_seed(0)
    calls = [torch.randn(b, n, 8, dtype=torch.float64, requires_grad=True) for b, n in ((2, 6), (3, 9), (2, 13), (4, 5))]
    _same_as_eager_in_one_symbolic_variant(InterleavedRotary(), calls, rtol=1e-12, atol=1e-12, grad_rtol=1e-12)


class LastTokenLogits(torch.nn.Module):
    """A sequence classifier's pooling (GPT-2's, Llama's): each row's logits at its last real
    token, ``logits[arange(batch), last]``, with ``last`` -1 where a row has no padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8, dtype=torch.float64)
        self.score = torch.nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.score(self.emb(ids).tanh())
        first_pad = (ids == 0).int().argmax(-1) - 1
        last = torch.where(first_pad < 0, -1, first_pad) if ids.shape[1] % 2 else first_pad % ids.shape[1]
        return logits[torch.arange(ids.shape[0]), last]


def test_rows_picked_by_two_index_tensors_serve_every_shape_in_one_variant() -> None:
    torch.manual_seed(0)
    calls = []
    for b, n in ((2, 6), (3, 9), (2, 13), (4, 5)):
        ids = torch.randint(1, 16, (b, n))
        ids[0, n // 2 :] = 0  # a padded row; the others have none (last = -1: read from the end)
        calls.append(ids)
    _same_as_eager_in_one_symbolic_variant(LastTokenLogits(), calls, rtol=1e-12, atol=1e-12, grad_rtol=1e-12,
                                           loss=lambda out: out.pow(2).sum())


class RowsAt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return (x * self.w)[rows, cols]


def test_two_index_tensors_out_of_range_raise_at_symbolic_sizes() -> None:
    eager = RowsAt()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    for b, n in ((3, 5), (4, 7)):  # the second compiles the symbolic variant
        x = torch.randn(b, n, 8, dtype=torch.float64)
        rows, cols = torch.tensor([0, b - 1, -1]), torch.tensor([1, -n, n - 1])
        torch.testing.assert_close(tvm(x, rows, cols), eager(x, rows, cols), rtol=0, atol=0)
    assert tvm._tvm_dispatch.variants[-1].symbolic, tvm._tvm_dispatch.explain()
    x = torch.randn(5, 6, 8, dtype=torch.float64)
    for rows, cols in ((torch.tensor([5]), torch.tensor([0])), (torch.tensor([0]), torch.tensor([-7]))):
        with pytest.raises(IndexError):
            eager(x, rows, cols)
        with pytest.raises(IndexError):
            tvm(x, rows, cols)


class SequenceWindows(torch.nn.Module):
    """ConvBERT's span convolution: ``F.unfold`` over the sequence (its windows padded along a
    symbolic length), and an explicit ``F.pad`` of the sequence axis."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # (batch, seq, 8)
        cols = torch.nn.functional.unfold(h.transpose(1, 2).unsqueeze(-1), kernel_size=[3, 1], padding=[1, 0])
        windows = cols.reshape(x.shape[0], 8, 3, x.shape[1]).mean(2).transpose(1, 2)
        padded = torch.nn.functional.pad(h, (0, 0, 2, 1))
        return (windows * h).sum() + padded[:, 1:].cos().sum()


def test_padding_along_a_symbolic_length_has_its_gradient() -> None:
    torch.manual_seed(0)
    calls = [torch.randn(b, n, 8, dtype=torch.float64, requires_grad=True) for b, n in ((2, 6), (3, 9), (2, 13), (4, 5))]
    _same_as_eager_in_one_symbolic_variant(SequenceWindows(), calls, rtol=1e-12, atol=1e-12, grad_rtol=1e-12)


class RowsFromEnd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return (x * self.w)[idx]


def test_negative_and_out_of_range_indices_along_a_symbolic_axis() -> None:
    """``x[idx]`` along a symbolic batch: negative indices count from the end and an index out of
    range raises, as in PyTorch (the symbolic variant read them unchecked: wrong rows, no error)."""
    eager = RowsFromEnd()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    for b in (3, 4, 6):
        x = torch.randn(b, 5, 8, dtype=torch.float64)
        idx = torch.tensor([-1, 0, -b, 1])
        torch.testing.assert_close(tvm(x, idx), eager(x, idx), rtol=0, atol=0)
    assert tvm._tvm_dispatch.variants[-1].symbolic, tvm._tvm_dispatch.explain()
    for idx in (torch.tensor([5]), torch.tensor([-6])):
        with pytest.raises(IndexError):
            eager(torch.randn(5, 5, 8, dtype=torch.float64), idx)
        with pytest.raises(IndexError):
            tvm(torch.randn(5, 5, 8, dtype=torch.float64), idx)
