"""Writes at computed indices (``frontend/converters/scatter.py``): ``x[idx] = v`` and ``+=``,
``index_add``/``index_copy``/``index_fill`` (which export as ``index_put``), ``scatter``,
``scatter_add``, ``put``, ``masked_scatter``; outputs and every gradient in float64 against
PyTorch. All were refused before (TVM's ``index_put`` wants one index tensor per dimension and
had no gradient; the others had no converter or no gradient)."""

from __future__ import annotations

import pytest
import torch

from tvmbridge import add_tvm_dispatch

from ..helpers import Fn
from .test_gradients_nn import check, randn

IDX = torch.tensor([3, 0, 3, 1])  # a repeat: accumulating writes add both
X, V = randn(5, 3), randn(4, 3, seed=1)
X3 = randn(3, 4, 5)


def set_rows(x, v):
    y = x.clone()
    y[torch.tensor([1, 0, 3])] = v[:3]
    return y * x


def set_apart(x, v):
    y = x * 1
    y[torch.tensor([1, 0]), :, torch.tensor([2, 4])] = v.T[:2, :4] * 2  # the indexed dims go in front
    return y * x


def add_after_a_slice(x, v):
    y = x * 1
    y[1:, torch.tensor([0, 3, 3])] += v[:2, :3, None]  # adjacent to a slice: the dims stay in place
    return y


def set_from_the_end(x, v):
    y = x.clone()
    y[torch.tensor([-1, 0])] = v[:2]
    return y


@pytest.mark.parametrize("fn,args", [
    (lambda x, v: torch.zeros(5, 3, dtype=x.dtype).index_add(0, IDX, v) * x, (X, V)),
    (lambda x, v: x.index_add(1, IDX, v.T[:, :4].repeat(1, 1)), (randn(3, 5), V)),
    (lambda x, v: x.index_put((IDX,), v, accumulate=True), (X, V)),
    (lambda x, v: x.index_put((IDX,), v[:, 0], accumulate=True), (randn(5), V)),
    (lambda x, v: x.index_copy(0, torch.tensor([4, 0]), v[:2]), (X, V)),
    (lambda x, v: x.index_fill(0, IDX, 0.5) * v.sum(), (X, V)),
    # a 0-d tensor value: its gradient sums each filled place once, however often the index names it
    (lambda x, v: x.index_fill(0, IDX, v[0, 0] * 2) * x, (X, V)),
    # negative indices count from the end, as ATen's index_fill counts them
    (lambda x, v: x.index_fill(-1, torch.tensor([-1, 0, -1]), 0.5).exp() * v.sum(), (X3, V)),
    (set_rows, (X, V)),
    (set_apart, (X3, V)),
    (add_after_a_slice, (X3, V)),
    (set_from_the_end, (X, V)),
    (lambda x, v: x.scatter_add(0, IDX[:, None].expand(4, 3), v), (X, V)),
    (lambda x, v: x.scatter(0, torch.tensor([[4, 0, 2]]), v[:1]), (X, V)),
    (lambda x, v: x.scatter(1, torch.tensor([[2], [0], [1], [2], [0]]), 1.5) * v.sum(), (X, V)),
    (lambda x, v: x.put(IDX * 3, v[:, 0], accumulate=True), (X, V)),
    (lambda x, v: x.masked_scatter(x > 0, v.reshape(-1).repeat(2)), (X, V)),
], ids=["index_add", "index_add_dim1", "add_rows", "add_1d", "index_copy", "index_fill", "index_fill_tensor",
                                        "index_fill_negative", "set_rows", "set_apart",
        "add_after_a_slice", "set_from_the_end", "scatter_add", "scatter", "scatter_value", "put", "masked_scatter"])
def test_writes_at_indices_train(fn, args):
    check(Fn(fn), *args)


@pytest.mark.parametrize("fn,bad", [
    (lambda x, i: x.index_add(0, i, x[:2] * 2), torch.tensor([5, 0])),
    (lambda x, i: x.index_put((i,), x[0], accumulate=True), torch.tensor([-6, 0])),
    (lambda x, i: x.scatter_add(0, i[:, None].expand(2, 3), x[:2]), torch.tensor([-1, 0])),  # no negatives
    (lambda x, i: x.put(i, x[0, :2]), torch.tensor([15, 0])),
], ids=["index_add", "index_put", "scatter_add", "put"])
def test_writes_out_of_range_raise_like_pytorch(fn, bad):
    """The index is kept inside the tensor for the write and the call raises PyTorch's error."""
    m = Fn(fn)
    add_tvm_dispatch(m, (X, torch.tensor([1, 0])))
    with pytest.raises((IndexError, RuntimeError)) as raised:
        fn(X, bad)
    with pytest.raises(raised.type, match="out of (bounds|range)"):
        m(X, bad)
