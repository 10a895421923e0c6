"""``Module.to`` that changes nothing, kept a no-op while the bridge traces.

A forward may cast a submodule to the dtype it already has on every call (Switch Transformers'
router: ``self.classifier = self.classifier.to(self.dtype)``). In eager that returns the module
itself; under ``torch.export`` the module's parameters are fake tensors that ``Module._apply``
tries to swap with themselves, and the trace failed ("_apply(): Couldn't swap Linear.weight").
While a trace runs in this thread, such a call returns the module as eager does; a cast that
changes something goes to PyTorch as before.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

from .trace_patches import ScopedPatch


def _changes_nothing(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if memory_format is not None:
        return False
    return all(
        (device is None or t.device == device)
        and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
        for t in itertools.chain(module.parameters(), module.buffers())
    )


def _module_to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """``nn.Module.to``, returning the module itself in a tracing thread where nothing would change."""
    if _PATCH.here and _changes_nothing(self, args, kwargs):
        return self
    return _PATCH.original(self, *args, **kwargs)


_PATCH = ScopedPatch(torch.nn.Module, "to", _module_to)


def noop_casts_kept() -> contextlib.AbstractContextManager[None]:
    """The block (a trace in this thread) keeps casts that change nothing as no-ops."""
    return _PATCH.scope()
