"""A result the trace folds to a constant (an integer a cache counts from a static size) is new
memory at every call (``backend/fresh_results``): the VM would hand out its constant pool's own
array, so a caller's in-place edit of one call's result changed every later call's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tvmbridge import add_tvm_dispatch, devices
from tvmbridge.backend import build

TARGET = devices.target_for(torch.device("cpu"))


def _constant_result_module() -> tvm.IRModule:
    """``main(x) = (x + 1, 16)``, the 16 returned through a variable bound to the tuple."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(x, relax.const(1.0, "float32")))
            out = bb.emit_output(relax.Tuple([y, relax.const(16, "int64")]))
        bb.emit_func_output(out)
    return bb.get()


def test_a_constant_result_is_fresh_memory_at_every_call():
    vm = build.load(build.compile_module(_constant_result_module(), TARGET), torch.device("cpu"))
    x = tvm.runtime.tensor(np.zeros(3, "float32"))
    first = torch.from_dlpack(vm["main"](x)[1])
    first.add_(5)  # as a generation loop advances its cache's length
    assert int(torch.from_dlpack(vm["main"](x)[1])) == 16


class CountsLength(torch.nn.Module):
    """Returns its output and the sequence length as a tensor, as a cache layer counts it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), torch.tensor(0) + x.shape[1]


@pytest.mark.parametrize("mode", ["no_grad", "train"])
def test_a_folded_length_edited_in_place_leaves_the_next_call_alone(mode):
    torch.manual_seed(0)
    model = CountsLength()
    add_tvm_dispatch(model)
    with torch.set_grad_enabled(mode == "train"):
        for batch in (2, 2, 3, 3):
            y, length = model(torch.randn(batch, 4))
            assert int(length) == 4
            length.add_(5)
    assert model._tvm_dispatch.calls_tvm == 4
