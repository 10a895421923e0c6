"""The vectorized dropout-mask kernel against ``Tensor.bernoulli_`` itself: same values, same
generator state afterwards, wherever in the MT19937 block the stream starts."""
from __future__ import annotations

import pytest
import torch

from tvmbridge.frontend.sites import RandomSite
from tvmbridge.kernels import mt19937 as rng
from tvmbridge.runtime.random import draw

pytestmark = pytest.mark.skipif(not rng.kernel_works(), reason="mask kernel's start-up check failed here")


@pytest.mark.parametrize("p", [0.9, 0.5, 0.0, 1.0, 0.123456789])
@pytest.mark.parametrize("skip", [0, 1, 311, 623, 624, 1000])  # words drawn before (rand: 1 each)
@pytest.mark.parametrize("shape", [(1,), (312,), (313,), (1, 14, 768), (2, 12, 64, 64)])
def test_matches_bernoulli_and_generator(p, skip, shape):
    torch.manual_seed(11)
    torch.rand(skip)  # 623: one word left in the block, 624: none (the next draw twists)
    start = torch.get_rng_state()
    want = torch.empty(shape).bernoulli_(p)
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    got = rng.bernoulli_(torch.empty(shape), p)
    assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), after)  # the stream goes on as after PyTorch's
    assert torch.equal(torch.rand(5), (torch.set_rng_state(after), torch.rand(5))[1])


def test_consecutive_draws_continue_the_stream():
    torch.manual_seed(3)
    want = [torch.empty(n).bernoulli_(0.8) for n in (1000, 7, 50000)]
    torch.manual_seed(3)
    got = [rng.bernoulli_(torch.empty(n), 0.8) for n in (1000, 7, 50000)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_refuses_what_it_does_not_reproduce():
    with pytest.raises(ValueError, match="contiguous float32"):
        rng.bernoulli_(torch.empty(4, dtype=torch.float64), 0.5)
    with pytest.raises(ValueError, match="contiguous float32"):
        rng.bernoulli_(torch.empty(4, 4).t(), 0.5)


@pytest.mark.parametrize("fast", [True, False], ids=["kernel", "fallback"])
def test_draw_masks_equal_eager_dropout(monkeypatch, fast):
    """The masks draw makes are F.dropout's masks, with the kernel and without it."""
    def site(shape, p):
        return RandomSite("dropout", shape, torch.empty(shape).stride(), torch.float32, p=p)

    sites = [site((4, 12, 64, 64), 0.1),  # above MIN_ELEMENTS
             site((4, 16, 64), 0.25),  # below: PyTorch's loop
             site((16, 64, 128), 0.5)]
    assert sites[0].shape[2] * 4 * 12 * 64 >= rng.MIN_ELEMENTS > 4 * 16 * 64
    calls = []
    kernel = rng.bernoulli_
    monkeypatch.setattr(rng, "bernoulli_", lambda t, p: calls.append(t.numel()) or kernel(t, p))
    torch.manual_seed(9)
    masks = draw(sites, torch.device("cpu"), use_kernel=fast)
    assert len(calls) == (2 if fast else 0)
    torch.manual_seed(9)
    for s, mask in zip(sites, masks):
        ones = torch.ones(s.shape)
        assert torch.equal(torch.nn.functional.dropout(ones, s.p, training=True), ones * mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_masks_from_the_kernel_equal_eager_dropout(monkeypatch, dtype):
    """An autocast model's bfloat16 dropout masks come from the float32 kernel (ATen draws the
    same stream for every dtype): F.dropout's masks, bit for bit, and the same generator state."""
    shapes = [(4, 12, 64, 64), (16, 64, 128)]
    sites = [RandomSite("dropout", s, torch.empty(s).stride(), dtype, p=p) for s, p in zip(shapes, (0.1, 0.3))]
    calls = []
    kernel = rng.bernoulli_
    monkeypatch.setattr(rng, "bernoulli_", lambda t, p: calls.append(t.numel()) or kernel(t, p))
    torch.manual_seed(5)
    masks = draw(sites, torch.device("cpu"))
    after = torch.get_rng_state()
    assert len(calls) == 2
    torch.manual_seed(5)
    for s, mask in zip(sites, masks):
        ones = torch.ones(s.shape, dtype=dtype)
        assert mask.dtype == dtype
        assert torch.equal(torch.nn.functional.dropout(ones, s.p, training=True), ones * mask)
    assert torch.equal(torch.get_rng_state(), after)
