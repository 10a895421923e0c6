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

from .value_asserts import AssertsLengths

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


@pytest.mark.parametrize("check", [False, True], ids=["assert", "torch_check"])
@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_a_condition_the_forward_asserts_on_a_value_is_checked_at_every_call(check: bool, grad: bool) -> None:
    """The condition held: compiled, PyTorch's numbers; broken: PyTorch's error, where the frontend
    dropped the assertion and the compiled call returned a number."""
    torch.manual_seed(0)
    eager = AssertsLengths(check)
    tvm = add_tvm_dispatch(copy.deepcopy(eager))
    error = AssertionError if not check else RuntimeError
    with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for b, n in ((2, 5), (3, 7), (3, 6)):  # an exact variant, then a symbolic one
            ids, mask = torch.randint(0, 10, (b, n)), torch.ones(b, n)
            got, want = tvm(ids, mask), eager(ids, mask)
            torch.testing.assert_close(got, want)
            if grad:  # the variant's first backward checked: trusted from here on
                got.backward()
            with pytest.raises(error):
                eager(ids, mask * 2)
            with pytest.raises(error):
                tvm(ids, mask * 2)
    assert any("a condition the forward asserts" in str(w.message) for w in said)  # once per reason
    assert tvm._tvm_dispatch.log.calls_fallback == 3
    assert tvm._tvm_dispatch.calls_tvm == 3  # every call ran compiled; the three broken ones count as PyTorch's
