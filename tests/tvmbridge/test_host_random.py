"""Random numbers a forward draws outside PyTorch (``frontend/host_random.py``): Python's ``random``
and numpy's global generator would be frozen into the compiled code at the trace's draw; such a
trace is refused with what to do, the user's streams are left as they were, and a module that
uses numpy for anything else compiles."""

from __future__ import annotations

import copy
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from tvmbridge import ConversionError, FallbackWarning, add_tvm_dispatch


class NumpyLayerDrop(nn.Module):
    """wav2vec2's adapter: ``if not self.training or np.random.random() > self.layerdrop``."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.training and np.random.random() < 0.5:
            return h
        return self.second(h)


class PythonJitter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * random.uniform(0.9, 1.1)


class NumpyConstant(nn.Module):
    """numpy for a constant only: no draw, nothing frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / float(np.sqrt(4.0))


def _streams() -> tuple:
    return np.random.get_state()[1].copy(), random.getstate()


@pytest.mark.parametrize(
    "make,which", [(NumpyLayerDrop, r"numpy's global generator"), (PythonJitter, r"Python's random module")]
)
def test_a_draw_outside_pytorch_is_refused_and_leaves_the_users_streams(make, which: str) -> None:
    np.random.seed(0)
    random.seed(0)
    before = _streams()
    with pytest.raises(ConversionError, match=rf"draws random numbers from {which}.*repeat the trace's draw"):
        add_tvm_dispatch(make(), (torch.randn(2, 4),))
    after = _streams()
    assert np.array_equal(before[0], after[0]) and before[1] == after[1]


@pytest.mark.parametrize("make", [NumpyLayerDrop, PythonJitter])
def test_with_fallback_the_draws_are_pytorchs_own_at_every_call(make) -> None:
    """The module's own code runs as PyTorch (its draws fresh at each call, from the user's
    seeded streams as eager's are); its submodules compile by themselves."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        add_tvm_dispatch(model, fallback=True)
        for step in range(4):
            x = torch.randn(3, 4)
            np.random.seed(step)
            random.seed(step)
            got = model(x)
            np.random.seed(step)
            random.seed(step)
            torch.testing.assert_close(got, ref(x))
    assert model._tvm_dispatch.variant_set.submodules and model._tvm_dispatch.calls_tvm == 0


def test_numpy_used_for_a_constant_compiles() -> None:
    model = NumpyConstant()
    x = torch.randn(2, 4)
    add_tvm_dispatch(model, (x,))
    torch.testing.assert_close(model(x), model._tvm_dispatch.eager(x))
    assert model._tvm_dispatch.calls_tvm == 1
