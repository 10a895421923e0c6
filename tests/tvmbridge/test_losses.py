"""Training losses and distances as users write them, through ``add_tvm_dispatch`` in float64: the loss and the
logits' gradient against PyTorch (targets with ignored classes, weights, smoothing, soft labels).
``multilabel_margin_loss`` with a ``-1`` end marker was wrong: torch's own decomposition counts
the places after the marker (caught only by the first-call check)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from ..helpers import Fn
from .test_gradients_nn import check, randn

X, Y = randn(6, 5), randn(6, 5, seed=2)
P = torch.rand(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
T = torch.tensor([0, 4, 2, 2, 1, 3])
T_IGNORED = torch.tensor([0, 4, -100, 2, 1, 3])
W = torch.linspace(0.5, 1.5, 5, dtype=torch.float64)
ENDS = torch.tensor([[1, 3, -1, 0, 0], [4, -1, 2, 2, 2], [0, 1, 2, 3, 4], [-1, 0, 0, 0, 0], [2, 0, -1, 1, 1], [3, 3, 1, -1, 0]])

LOSSES = {
    "cross_entropy": lambda x: F.cross_entropy(x, T),
    "cross_entropy_weight_ignore_smoothing": lambda x: F.cross_entropy(x, T_IGNORED, weight=W, label_smoothing=0.2),
    "cross_entropy_soft_labels": lambda x: F.cross_entropy(x, P.softmax(-1)),
    "cross_entropy_per_position": lambda x: F.cross_entropy(x.reshape(2, 5, 3), T.reshape(2, 3), reduction="none"),
    "nll_weighted": lambda x: F.nll_loss(F.log_softmax(x, -1), T_IGNORED, weight=W),
    "smooth_l1": lambda x: F.smooth_l1_loss(x, Y, beta=0.5),
    "huber": lambda x: F.huber_loss(x, Y, delta=0.7),
    "bce_with_logits_pos_weight": lambda x: F.binary_cross_entropy_with_logits(x, P, pos_weight=W),
    "kl_div_log_target": lambda x: F.kl_div(F.log_softmax(x, -1), F.log_softmax(Y, -1), reduction="batchmean", log_target=True),
    "poisson_nll": lambda x: F.poisson_nll_loss(x, P),
    "cosine_embedding": lambda x: F.cosine_embedding_loss(x, Y, torch.tensor([1, -1, 1, 1, -1, 1])),
    "triplet_margin": lambda x: F.triplet_margin_loss(x, Y, P),
    "multi_margin": lambda x: F.multi_margin_loss(x, T),
    "multilabel_margin": lambda x: F.multilabel_margin_loss(x, ENDS),
    "multilabel_margin_sum": lambda x: F.multilabel_margin_loss(x, ENDS, reduction="sum"),
    "multilabel_margin_per_row": lambda x: F.multilabel_margin_loss(x, ENDS, reduction="none"),
    "multilabel_soft_margin": lambda x: F.multilabel_soft_margin_loss(x, (P > 0.5).double()),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_and_its_gradient_as_pytorch(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a variant discarded by the first-call check fails
        check(Fn(LOSSES[name]), X.clone())


A, B = randn(6, 5), randn(4, 5, seed=2)
B[1] = A[2]  # an equal pair: distance 0, gradient 0 in ATen (NaN through a plain sqrt)


@pytest.mark.parametrize("fn,args", [
    (lambda a, b: torch.cdist(a, b), (A, B)),
    (lambda a, b: torch.cdist(a, b, p=1), (A, B)),
    (lambda a, b: torch.cdist(a, b, p=3.0), (A, B)),
    (lambda a, b: torch.cdist(a, b, p=0.5), (A, B)),
    (lambda a, b: torch.cdist(a, b, p=0) * a.sum(), (A, B)),
    (lambda a, b: torch.cdist(a, a), (A, B)),
    (lambda a, b: torch.cdist(a.reshape(2, 3, 5), b.reshape(2, 2, 5)), (A, B)),
    (lambda a, b: torch.cdist(a, b), (randn(30, 5), randn(28, 5, seed=1))),  # ATen's matrix-product form
], ids=["p2", "p1", "p3", "p_half", "p0", "self", "batched", "matrix_product_form"])
def test_cdist_and_its_gradient_as_pytorch(fn, args):
    """``_cdist_forward`` had no converter (metric learning, prototype classifiers)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(Fn(fn), *(t.clone() for t in args))


ROW = torch.tensor([[2], [0], [4], [4], [1], [3]])  # one index per row: the one-hot gradient form
COL = torch.tensor([[5, 0, 2, 1, 3]])  # one per column, along dim 0
PAIRS = torch.tensor([[2, 2], [0, 1], [4, 3], [4, 4], [1, 0], [3, 3]])  # two per row (a repeat): scatter-add


@pytest.mark.parametrize("fn", [
    lambda x: x.gather(1, ROW).sum(),
    lambda x: (x.log_softmax(-1).gather(1, ROW) ** 2).sum() + x.log_softmax(-1).gather(1, ROW).sum(),
    lambda x: x.exp().gather(0, COL) * 3,
    lambda x: x.log_softmax(0).gather(0, COL).sum(0, keepdim=True),
    lambda x: x.gather(1, PAIRS) * torch.arange(12, dtype=torch.float64).reshape(6, 2),
    lambda x: x.log_softmax(-1).gather(1, PAIRS).sum(),
    lambda x: x.gather(1, ROW[:4]) * torch.arange(1, 5, dtype=torch.float64).reshape(4, 1),
    lambda x: x.log_softmax(0).gather(0, COL[:, :3]).sum(),
], ids=["rows", "log_softmax_rows_twice", "columns", "log_softmax_columns", "pairs", "log_softmax_pairs",
        "rows_of_a_block", "columns_of_a_block"])
def test_gather_gradient_as_pytorch(fn):
    """``gather``'s gradient: a one-hot where each row (or column) reads one element, a sum of
    those one-hots over the axis folded to the read values (``simplify.one_hot_sums``), and a
    scatter-add where a row reads several (a repeated index counted twice); an index smaller than
    the input in another dim reads a block (the one-hot would have the index's rows: the gradient
    failed to build, 'not broadcastable')."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(Fn(fn), X.clone())


class _TokenLoss(torch.nn.Module):
    """A language model's head and loss as transformers writes it: labels come in with sizes of
    their own, equal to the logits' rows only at run time."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 11)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def test_a_class_index_loss_compiles_symbolic_where_labels_have_their_own_sizes():
    """The second batch size and length compile one symbolic variant: the loss gradient's one-hot
    had the labels' rows (s26 * s0) where the logits have theirs (s87 * s85), and every symbolic
    compile of a transformers model with labels failed ('gradient of relax.add failed: NoneType'),
    leaving a compile per shape; gradients as PyTorch's at each shape."""
    from tvmbridge import add_tvm_dispatch

    torch.manual_seed(0)
    model = _TokenLoss()
    eager = _TokenLoss()
    eager.load_state_dict(model.state_dict())
    add_tvm_dispatch(model)
    for batch, length in ((2, 5), (3, 7), (4, 3)):
        x = torch.randn(batch, length, 8)
        labels = torch.randint(0, 11, (batch, length))
        labels[0, -1] = -100
        model(x, labels).backward()
        eager(x, labels).backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
            p.grad, q.grad = None, None
    variants = model._tvm_dispatch.variants
    assert len(variants) == 2 and variants[1].symbolic, [v.why for v in variants]
