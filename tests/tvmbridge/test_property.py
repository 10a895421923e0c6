"""Property: any small stack of supported layers, in train or eval mode, gives PyTorch's outputs
and gradients through the bridge (hypothesis draws the stacks; seeds fixed per example)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tvmbridge import add_tvm_dispatch

from ..helpers import clone_module, is_tvm, relative_errors, run_step

C, H = 4, 6  # channels and spatial size of the image stacks; width of the vector stacks


def _image_layer(kind: str) -> nn.Module:
    return {
        "conv": nn.Conv2d(C, C, 3, padding=1),
        "bn": nn.BatchNorm2d(C),
        "relu": nn.ReLU(),
        "gelu": nn.GELU(),
        "silu": nn.SiLU(),
        "maxpool": nn.MaxPool2d(3, stride=1, padding=1),
        "avgpool": nn.AvgPool2d(3, stride=1, padding=1),
        "dropout2d": nn.Dropout2d(0.3),
        "dropout": nn.Dropout(0.2),
    }[kind]


def _vector_layer(kind: str) -> nn.Module:
    return {
        "linear": nn.Linear(H, H),
        "layernorm": nn.LayerNorm(H),
        "bn1d": nn.BatchNorm1d(H),
        "tanh": nn.Tanh(),
        "sigmoid": nn.Sigmoid(),
        "gelu": nn.GELU(approximate="tanh"),
        "dropout": nn.Dropout(0.2),
    }[kind]


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class Stack(nn.Module):
    def __init__(self, image: list[str], vector: list[str], residual: bool) -> None:
        super().__init__()
        body = nn.Sequential(*[_image_layer(k) for k in image])
        self.image = Residual(body) if residual else body
        self.head = nn.Linear(C * H * H, H)
        self.vector = nn.Sequential(*[_vector_layer(k) for k in vector])

    def forward(self, x):
        return self.vector(self.head(self.image(x).flatten(1)))


stacks = st.tuples(
    st.lists(st.sampled_from(["conv", "bn", "relu", "gelu", "silu", "maxpool", "avgpool", "dropout2d", "dropout"]),
             min_size=1, max_size=4),
    st.lists(st.sampled_from(["linear", "layernorm", "bn1d", "tanh", "sigmoid", "gelu", "dropout"]), max_size=3),
    st.booleans(),
    st.booleans(),
)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(stacks)
def test_random_stacks_match_pytorch(stack):
    image, vector, residual, train = stack
    torch.manual_seed(0)
    m = Stack(image, vector, residual).train(train)
    ref = clone_module(m)
    x = torch.randn(3, C, H, H)
    add_tvm_dispatch(m, (x,))
    got, want = run_step(m, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0]), m._tvm_dispatch.explain()
    errs = relative_errors(got, want)
    assert max(errs.values()) <= 1e-4, (stack, errs)  # float32 through up to 4 convs and a batch norm
    for (name, a), (_, b) in zip(m.named_buffers(), ref.named_buffers()):  # running statistics too
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6), (stack, name)
