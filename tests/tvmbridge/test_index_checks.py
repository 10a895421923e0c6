"""Every op that reads or writes at indices, against PyTorch on good and bad indices, in an exact
and in a symbolic variant: the same numbers for indices in range, and an error wherever PyTorch
raises (an index past the end, before the start, or negative where the op refuses negatives),
never a read or write at a wrong place. Found by sweeping the ops: ``index_select``, a write of
run-time length (``index_fill``) and a read along a symbolic axis read their indices unchecked;
``index_add``/``index_copy`` wrapped negative indices where ATen raises."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tvmbridge import add_tvm_dispatch

F64 = torch.float64


def _ones(i: torch.Tensor) -> torch.Tensor:
    return torch.ones(len(i), 6, dtype=F64)


OPS = {
    "index_select": lambda x, i: x.index_select(0, i),
    "scatter_add": lambda x, i: x.scatter_add(0, i[:, None].expand(-1, 6), _ones(i)),
    "scatter": lambda x, i: x.scatter(0, i[:, None].expand(-1, 6), 1.0),
    "index_add": lambda x, i: x.index_add(0, i, _ones(i)),
    "index_copy": lambda x, i: x.index_copy(0, i[:1], _ones(i[:1])),
    "index_fill": lambda x, i: x.index_fill(0, i, 2.0),
    "take_along_dim": lambda x, i: torch.take_along_dim(x, i[:, None].expand(-1, 6), 0),
    "gather": lambda x, i: x.gather(0, i[:, None].expand(-1, 6)),
    "index_put": lambda x, i: x.index_put((i,), torch.ones(6, dtype=F64)),
    "index_put_accumulate": lambda x, i: x.index_put((i,), torch.ones(6, dtype=F64), accumulate=True),
    "getitem": lambda x, i: x[i],
    "embedding": lambda x, i: torch.nn.functional.embedding(i, x),
}


class AtIndices(torch.nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, dtype=F64))
        self.op = op

    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self.op(x * self.w, i)


def _outcome(module: torch.nn.Module, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor | None:
    """The result, or None where the call raised."""
    try:
        return module(x, i)
    except (IndexError, RuntimeError):
        return None


@pytest.mark.parametrize("name", sorted(OPS))
def test_indices_read_and_written_as_pytorch_does(name: str) -> None:
    torch.manual_seed(0)
    eager = AtIndices(OPS[name])
    tvm = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (4, 7):  # an exact variant, then (where the op allows) a symbolic one
            x = torch.randn(n, 6, dtype=F64)
            good = torch.tensor([1, 0, 2])
            torch.testing.assert_close(tvm(x, good), eager(x, good), rtol=0, atol=0)
            for bad in (torch.tensor([1, n]), torch.tensor([1, -n - 1]), torch.tensor([-1, 0])):
                want, got = _outcome(eager, x, bad), _outcome(tvm, x, bad)
                assert (want is None) == (got is None), f"index {bad.tolist()} at size {n}: eager {want}, tvm {got}"
                if want is not None:
                    torch.testing.assert_close(got, want, rtol=0, atol=0)
