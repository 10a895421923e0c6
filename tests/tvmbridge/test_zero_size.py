"""Zero-size dimensions are legal in PyTorch; TVM's kernels and gradients mis-handle them (wrong
strides at the call, unsorted split indices in the build). A sample, a call, a parameter or an
intermediate value with one gives PyTorch's result: a clear refusal at compile, or PyTorch with a
``FallbackWarning``, never a crash."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from analysis.memory.partition import PartitionGraph, PartitionNode, min_cut
from tvmbridge import ConversionError, FallbackWarning, add_tvm_dispatch

from ..helpers import Fn, clone_module, is_tvm, max_errors, run_step


def same_as_pytorch(module: nn.Module, ref: nn.Module, x: torch.Tensor) -> None:
    errs = max_errors(run_step(module, (x,)), run_step(ref, (x,)))
    assert max(errs.values(), default=0.0) == 0.0, errs


@pytest.mark.parametrize("make,x", [
    (lambda: nn.Linear(4, 3), torch.randn(0, 4)),
    (lambda: Fn(lambda x: torch.cat([x[:, :0] * 2, x.exp()], 1)), torch.randn(3, 4)),
    (lambda: Fn(lambda x: torch.split(x, [0, 4], 1)[1].exp()), torch.randn(3, 4)),
    (lambda: Fn(lambda x: x[:, :0] @ x[:0, :] + x.sin()), torch.randn(4, 4)),
    (lambda: nn.Linear(4, 0), torch.randn(3, 4)),
], ids=["empty_sample", "empty_slice_in_cat", "split_part_of_size_0", "empty_matmul", "empty_parameter"])
def test_zero_size_is_refused_clearly_or_falls_back_with_a_warning(make, x):
    """Before: a build error, or a crash at the call (``expected to be compact array``)."""
    torch.manual_seed(0)
    with pytest.raises(ConversionError, match="zero-size"):
        add_tvm_dispatch(make(), (x,))
    m = make()
    ref = clone_module(m)
    with pytest.warns(FallbackWarning, match="zero-size"):
        add_tvm_dispatch(m, (x,), fallback=True)
    same_as_pytorch(m, ref, x)


def test_empty_call_after_a_compile_runs_pytorch_with_a_warning():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2))
    ref = clone_module(m)
    add_tvm_dispatch(m, (torch.randn(3, 4),))
    empty = torch.randn(0, 4)
    with pytest.warns(FallbackWarning, match="dim 0 is 0"):
        same_as_pytorch(m, ref, empty)
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        out = m(x)
    assert is_tvm(out) and torch.allclose(out, ref(x), atol=1e-6)


def test_legacy_empty_cat_still_compiles():
    """A 1-D empty tensor that only ``cat`` reads is dropped by the converter (transformers' key/value
    cache starts from ``torch.tensor([])``): not refused."""
    m = Fn(lambda x: torch.cat([torch.tensor([]), x.flatten()]).tanh())
    x = torch.randn(3, 4, dtype=torch.float64)
    ref = clone_module(m)
    add_tvm_dispatch(m, (x,))
    got, want = run_step(m, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0]) and max(max_errors(got, want).values()) < 1e-12


def test_min_cut_keeps_a_zero_byte_value_for_free():
    """A zero-size tensor the backward reads costs 0 bytes to keep: the cut is finite."""
    nodes = {
        "x": PartitionNode("x", [], 64, True, is_input=True),
        "empty": PartitionNode("empty", ["x"], 0, False, keepable=True),
        "y": PartitionNode("y", ["x", "empty"], 64, False),
    }
    cut = min_cut(PartitionGraph(nodes, backward_reads={"empty", "y"}))
    assert set(cut.saved) == {"empty", "y"} and cut.saved_bytes == 64
