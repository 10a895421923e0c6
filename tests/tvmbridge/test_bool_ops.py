"""Boolean tensors compared, added, reduced, scanned and sorted (``frontend/bool_ops.py``, the
``cumsum`` converter): each as PyTorch computes it, outputs and gradients in float64.
TVM's code generation has no arithmetic of its ``bool`` type: all but three cases (``argmax`` of
an int cast, ``any``/``all``, the logical ops) failed to compile or to run, and a bool ``cumsum``
came out bool."""

from __future__ import annotations

import warnings

import pytest
import torch

from tvmbridge import add_tvm_dispatch

from ..helpers import Fn, is_tvm
from .test_gradients_nn import check, randn

X = randn(4, 6)
MASK = randn(4, 6, seed=3) > 0

CASES = {
    "greater_than_zero": lambda x, m: torch.where(m > 0, x, -1e4),  # HF's `mask > 0`
    "less_than_one": lambda x, m: torch.where(m < 1, x, -1e4),
    "bool_vs_bool": lambda x, m: torch.where(m >= m.flip(-1), x, -1e4),
    "equal_true": lambda x, m: torch.where(m == True, x, -1e4),  # noqa: E712 - the case itself
    "equal_int": lambda x, m: torch.where(m == 1, x, 2 * x),
    "max_all": lambda x, m: x * m.max(),
    "amax": lambda x, m: x * m.amax(0),
    "add": lambda x, m: x * (m + m.flip(-1)),
    "mul": lambda x, m: x * (m * m.flip(0)),
    "maximum": lambda x, m: x * torch.maximum(m, m.flip(0)),
    "min_dim": lambda x, m: x * m.min(-1, keepdim=True).values,
    "max_dim": lambda x, m: x * m.max(-1, keepdim=True).values + m.max(0).indices[None],
    "cumsum": lambda x, m: x * m.cumsum(-1),  # int64 in PyTorch; the frontend kept bool
    "cumprod": lambda x, m: x * m.cumprod(-1),
    "argmax": lambda x, m: x * m.int().argmax(-1, keepdim=True),
    "sort": lambda x, m: x * m.sort(-1).values,
    "any_all": lambda x, m: x * m.any(-1, keepdim=True) + x * m.all(0),
    "logical": lambda x, m: torch.where((~m & m.flip(0)) ^ m.flip(-1), x, 0.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bool_op_as_pytorch(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a discarded variant or a fallback fails the case
        check(Fn(CASES[name]), X.clone(), MASK)


def test_float32_cumsum_accumulates_in_double_as_aten():
    """ATen's CPU ``cumsum`` adds in double and rounds each element once: bit for bit."""
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(0), requires_grad=True)
    m = Fn(lambda x: x.cumsum(-1) * 1.5)
    want = m(x)
    add_tvm_dispatch(m, (x,))
    got = m(x)
    assert is_tvm(got) and torch.equal(got, want)


# TVM's sort and top-k kernels have no comparison for 8- and 16-bit integers: all of these
# failed to compile (the first-call check or a refusal handed them to PyTorch); read as int32 now
def narrow_sorts(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return (
        x * n.sort(-1).values.to(x.dtype)
        + x * n.sort(dim=-1, descending=True, stable=True).indices
        + x * n.argsort(dim=0, stable=True)
        + (x[:, :2] * n.topk(2, -1).values + n.topk(3, 0).values.sum(0)[:2]).sum()
        + x * n.max(-1, keepdim=True).values + n.min(0).values
        + x * n.argmax(-1, keepdim=True) + n.argmin(0)
    )


NARROW_VALUES = {  # uint8 above 127 and signed negatives: a wrong cast shows
    torch.int8: torch.tensor([-128, -3, 0, 5, 127, -1]),
    torch.uint8: torch.tensor([0, 3, 128, 200, 255, 17]),
    torch.int16: torch.tensor([-32768, -300, 0, 7, 32767, 1000]),
}


@pytest.mark.parametrize("dtype", list(NARROW_VALUES), ids=str)
def test_sorts_of_narrow_integers_as_pytorch(dtype):
    values = NARROW_VALUES[dtype]
    n = values[torch.randint(0, 6, (4, 6), generator=torch.Generator().manual_seed(1))].to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(Fn(narrow_sorts), X.clone(), n)
