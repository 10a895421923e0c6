"""Tensors inside Python values, and storage identity: shared by the profiler and the memory tools."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Every tensor in a pytree (tuples, lists, dicts, ...), in leaf order."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """A key equal for tensors that share a storage (views, in-place results), for real, fake and
    meta tensors alike. Hold the tensor while the key is in use: a freed storage's key can be
    reused."""
    return StorageWeakRef(t.untyped_storage())
