"""`MetaTensorMode`: build models and run ops without allocating real memory.

Built on PyTorch's FakeTensorMode: tensors keep their device, dtype, shape and strides (so
device-aware code and shape-dependent control flow behave as on a real run) but own no data.
This module is the single place that creates fake modes, so that tracing and profiling share one
mode with the model's fake parameters (mixing fake tensors of two modes is an error in PyTorch).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map

__all__ = ["MetaTensorMode", "active_fake_mode", "find_fake_mode", "is_fake", "to_fake"]


class MetaTensorMode:
    """Context in which module construction and tensor creation allocate no real memory.

    ``with MetaTensorMode() as mode: model = BertModel(cfg); x = torch.randn(8, 128, 768)``
    gives a model whose parameters are fake tensors and a fake input. Real tensors that meet fake
    ones inside the mode are converted (``allow_non_fake_inputs``), never computed on.
    """

    def __init__(self, fake_mode: FakeTensorMode | None = None) -> None:
        self.fake_mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)

    def __enter__(self) -> MetaTensorMode:
        self.fake_mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fake_mode.__exit__(*exc)

    def from_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A fake twin of ``t`` (same shape, dtype, device, requires_grad), see `to_fake`."""
        return to_fake(t, self.fake_mode)


def is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


def active_fake_mode() -> FakeTensorMode | None:
    """The FakeTensorMode currently entered, if any (so nested calls reuse it)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode()


def find_fake_mode(values: Iterable[Any]) -> FakeTensorMode | None:
    """The fake mode of the first fake tensor among ``values``, else the active one."""
    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return active_fake_mode()


def to_fake(t: Any, mode: FakeTensorMode, device: torch.device | str | None = None) -> Any:
    """Convert a real or meta-device tensor (or a pytree of them) to fake tensors of ``mode``.

    Meta-device tensors become fake tensors on ``device`` (default cpu): PyTorch's meta device
    has no kernels for mixing with cpu weights, fake tensors do. Fake tensors of ``mode`` pass.
    """

    def conv(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if isinstance(x, FakeTensor):
            if x.fake_mode is not mode:
                raise ValueError(
                    "tensor belongs to another FakeTensorMode; build model and inputs under one MetaTensorMode"
                )
            return x
        if x.device.type == "meta":
            with mode:
                y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device or "cpu")
            return y.requires_grad_(x.requires_grad) if x.is_floating_point() else y
        return mode.from_tensor(x, static_shapes=True)

    return tree_map(conv, t)
