"""Long float32 sums accumulated in float64 (``passes/accumulation.py``): which reductions are
rewritten, and a scalar parameter's gradient (a sum over a whole batch) as close to float64 as
eager's, where TVM's lane-by-lane float32 sum was an order of magnitude further."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm import relax

from tvmbridge import add_tvm_dispatch
from tvmbridge.passes.accumulation import LONG_SUM, LongSumsInFloat64, terms_per_result


def _reduced(shape: tuple, make, dtype: str = "float32") -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(make(x))
        bb.emit_func_output(out)
    return bb.get()


def _wide_sums(mod: tvm.IRModule) -> int:
    """Reductions rewritten: each reads a float64 cast of its input and rounds its result."""
    return LongSumsInFloat64()(mod).script().count('R.astype(x, dtype="float64")')  # type: ignore[operator]


@pytest.mark.parametrize(
    ("shape", "make", "wide"),
    [
        ((2, 16, 64, 64), lambda x: relax.op.sum(x), True),  # everything into one value
        ((64, 128), lambda x: relax.op.sum(x, axis=[1]), False),  # rows of 128: short
        ((8192, 4), lambda x: relax.op.mean(x, axis=[0]), True),  # columns of 8192
        ((8192, 4), lambda x: relax.op.collapse_sum_to(x, (1, 4)), True),  # a bias gradient over 8192 rows
        ((16, 4), lambda x: relax.op.collapse_sum_to(x, (1, 4)), False),
        ((tvm.tirx.Var("n", "int64"), 4), lambda x: relax.op.sum(x, axis=[0]), True),  # unknown: long
        ((8192, 4), lambda x: relax.op.sum(x, axis=[0]), False),  # float64 already (dtype below)
    ],
)
def test_long_float32_reductions_and_only_those_accumulate_in_float64(shape, make, wide):
    dtype = "float64" if (shape, wide) == ((8192, 4), False) else "float32"
    mod = _reduced(shape, make, dtype)
    assert (_wide_sums(mod) == 1) == wide
    out = LongSumsInFloat64()(mod)["main"]  # type: ignore[operator]
    assert str(out.ret_ty.dtype) == dtype  # the result keeps its dtype


def test_terms_per_result_counts_what_each_output_folds():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 32, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            calls = [bb.normalize(relax.op.sum(x, axis=[0, 2])), bb.normalize(relax.op.collapse_sum_to(x, (32, 1)))]
            out = bb.emit_output(calls[0])
        bb.emit_func_output(out)
    assert [terms_per_result(c) for c in calls] == [8 * 64, 8 * 64]
    assert LONG_SUM > 512


class LearnableAffine(torch.nn.Module):
    """HGNetV2's ``LearnableAffineBlock``: one scale and one bias for the whole tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.0]))
        self.bias = torch.nn.Parameter(torch.tensor([0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.scale * x + self.bias)


def test_a_scalar_parameter_gradient_over_a_batch_is_as_close_to_float64_as_eager():
    torch.manual_seed(0)
    x, g = torch.randn(2, 16, 64, 64), torch.randn(2, 16, 64, 64)

    def grads(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        module(x).backward(g.to(x.dtype))
        return torch.cat([module.scale.grad, module.bias.grad]).double()

    exact = grads(LearnableAffine().double(), x.double())
    eager_err = (grads(LearnableAffine(), x) - exact).abs()
    tvm_err = (grads(add_tvm_dispatch(LearnableAffine(), (x,)), x) - exact).abs()
    assert (tvm_err <= 2 * eager_err + 1e-6).all(), (tvm_err, eager_err)
