"""Outputs holding objects torch's pytree does not know (transformers' key/value caches): the
module's output comes back as an equal object around the compiled tensors, gradients flow
through its tensors, and no global pytree registration is made."""
from __future__ import annotations

import copy

import torch
import torch.utils._pytree as pytree

from tvmbridge import add_tvm_dispatch
from tvmbridge.frontend.outputs import flatten_output, unflatten_output


class Layer:
    """A cache layer: tensors, a flag and a device, as transformers' ``DynamicLayer``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values, self.is_initialized, self.device = keys, values, True, keys.device


class Cache:
    """A plain object with a list of layers and a dict of flags (``EncoderDecoderCache``'s shape)."""

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.is_updated = {i: True for i in range(len(layers))}


class WithCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.v = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> dict:
        k, v = self.k(x), self.v(x)
        cache = Cache([Layer(k, v), Layer(k * 2, v.tanh())])
        return {"out": (k @ v.transpose(-1, -2)).softmax(-1), "cache": cache}


def test_flatten_and_rebuild_keep_the_objects_structure() -> None:
    x = torch.randn(2, 3)
    out = {"a": x, "c": Cache([Layer(x, x + 1)])}
    flat, layout = flatten_output(out)
    assert len(flat) == 3 and flat[0] is x
    again = unflatten_output([t * 10 for t in flat], layout)
    assert isinstance(again["c"], Cache) and isinstance(again["c"].layers[0], Layer)
    torch.testing.assert_close(again["c"].layers[0].values, (x + 1) * 10)
    assert again["c"].is_updated == {0: True} and again["c"].layers[0].is_initialized
    assert Cache not in pytree.SUPPORTED_NODES and Layer not in pytree.SUPPORTED_NODES


def test_an_output_cache_is_rebuilt_and_its_tensors_carry_gradients() -> None:
    torch.manual_seed(0)
    eager = WithCache()
    tvm = add_tvm_dispatch(copy.deepcopy(eager), fallback=False)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    got, want = tvm(x), eager(x)
    assert type(got["cache"]) is Cache and len(got["cache"].layers) == 2
    for g, w in zip(got["cache"].layers, want["cache"].layers):
        torch.testing.assert_close(g.keys, w.keys, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g.values, w.values, rtol=1e-12, atol=1e-12)
    loss_got = got["out"].sum() + got["cache"].layers[1].values.pow(2).sum()
    loss_want = want["out"].sum() + want["cache"].layers[1].values.pow(2).sum()
    loss_got.backward()
    loss_want.backward()
    for name in ("k.weight", "v.weight", "v.bias"):
        torch.testing.assert_close(tvm.get_parameter(name).grad, eager.get_parameter(name).grad,
                                   rtol=1e-12, atol=1e-12)
    assert Cache not in pytree.SUPPORTED_NODES


class LossIfLabels(torch.nn.Module):
    """A user's model: ``{"loss": None, ...}`` without labels, a tuple with a constant tag."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.fc(x)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits, "extra": (None, 3, "head", 0.5, True)}


def test_constant_output_leaves_come_back_as_they_are() -> None:
    """``loss=None`` in eval (and a tuple of constants) was refused ("output None is not a
    tensor") and every such call ran PyTorch with a warning."""
    import warnings

    from tvmbridge import FallbackWarning

    torch.manual_seed(0)
    m = LossIfLabels()
    ref = copy.deepcopy(m)
    x, y = torch.randn(5, 4), torch.tensor([0, 2, 1, 1, 0])
    add_tvm_dispatch(m, (x,), {"labels": y})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        got, want = m(x, labels=y), ref(x, labels=y)
        got["loss"].backward()
        want["loss"].backward()
        assert torch.allclose(m.fc.weight.grad, ref.fc.weight.grad, atol=1e-6)
        m.eval(), ref.eval()
        with torch.no_grad():
            got, want = m(x), ref(x)
    assert got["loss"] is None and got["extra"] == (None, 3, "head", 0.5, True)
    assert torch.allclose(got["logits"], want["logits"], atol=1e-6)
    assert "ran the compiled code" in m._tvm_dispatch.explain()
