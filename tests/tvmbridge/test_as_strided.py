"""``as_strided`` (Longformer/LED's overlapping attention chunks) against PyTorch: the windows a
stride names in the input's storage, from a contiguous or a transposed view, and their gradient
(overlaps summed) in float64; a read past the input's own elements is refused."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import Fn, strict_net
from tvmbridge import UnsupportedOpError, add_tvm_dispatch


def overlapping_chunks(x: torch.Tensor, window: int = 2) -> torch.Tensor:
    """Longformer's ``_chunk``: windows of ``2 * window`` rows overlapping by half, from the
    strides of the view they are taken from (transposed or not)."""
    b, n, d = x.shape
    x = x.view(b, n // (2 * window), 2 * window, d)
    size, stride = list(x.size()), list(x.stride())
    size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
    return x.as_strided(size=size, stride=stride)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_overlapping_windows_and_their_gradients_match_pytorch(layout: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(7, 4, 1, dtype=torch.float64)

    def windows(x: torch.Tensor) -> torch.Tensor:
        if layout == "transposed":  # (seq, batch, dim) -> (batch, seq, dim): strides (dim, batch*dim, 1)
            x = x.transpose(0, 1)
        return (overlapping_chunks(x).tanh() * weight).sum(-1)

    shape = (16, 3, 5) if layout == "transposed" else (3, 16, 5)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    module = add_tvm_dispatch(Fn(windows), (x,))
    with strict_net():
        got = module(x)
        (grad,) = torch.autograd.grad(got.square().sum(), x)
    want = windows(x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    assert module._tvm_dispatch.calls_tvm == 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


def test_a_window_past_the_inputs_own_elements_is_refused() -> None:
    """A view's storage can hold more than the view: compiled code has only the view."""

    def past_the_view(x: torch.Tensor) -> torch.Tensor:
        return x.as_strided((2, 4), (4, 1), 8)  # reads elements 8..15 of a 3 x 4 input

    with pytest.raises(UnsupportedOpError, match="as_strided"):
        add_tvm_dispatch(Fn(past_the_view), (torch.randn(3, 4),))
