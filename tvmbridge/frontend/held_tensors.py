"""Tensors a module holds outside its parameters and buffers, made inputs of the compiled call.

``self.scale = torch.tensor(2.0)``, a cache dict filled in eval mode (LeViT's, EfficientFormer's,
TinyViT's attention biases: ``self.attention_bias_cache[device] = biases[:, idx]``), a tuple of
rotary tables: torch.export lifts such a tensor as a constant, and compiled in as one, any new
value (the cache refilled after training, the scale set by a schedule) meant a new compile, each
eval phase of a training loop another. Here each is a slot (module path, attribute, key in the
dict, list or tuple) read at every call and passed like a buffer: the variant fits any value of
the same shape, dtype and device, and reads it. A tensor the slot holds that is a parameter or
buffer (transformers' ``self.original_inv_freq = self.inv_freq``) is that tensor's alias, traced
as it. Private attributes (``nn.LSTM``'s ``_flat_weights``, rebuilt by its module) and tensors
that cannot be inputs (another device, sparse, inference-mode, subclasses) stay compiled in as
constants, guarded by identity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

NO_KEY = None  # the attribute itself holds the tensor
HeldSlot = tuple[str, str, Any]  # (module path, attribute, key in its container or NO_KEY)
_MAX_ENTRIES = 64


def _holdable(t: Any, device: torch.device | None) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_inference()
        and t.device.type != "meta"
        and (device is None or t.device == device)
    )


def _entries(value: Any) -> Iterator[tuple[Any, Any]]:
    """``(key, entry)`` of a dict with str/int keys, a list or a tuple; nothing for other values."""
    if type(value) in (dict, OrderedDict) and len(value) <= _MAX_ENTRIES:
        if all(type(k) in (str, int) for k in value):
            yield from value.items()
    elif type(value) in (list, tuple) and len(value) <= _MAX_ENTRIES:
        yield from enumerate(value)


def held_slots(module: torch.nn.Module, device: torch.device | None) -> Iterator[tuple[HeldSlot, torch.Tensor]]:
    """Every slot of a public attribute that holds a tensor an input can replace, with that tensor;
    each module once (a module registered twice has one ``__dict__``)."""
    from .call_state import MODULE_INTERNALS

    for path, m in module.named_modules():
        for attr, value in vars(m).items():
            if attr.startswith("_") or attr in MODULE_INTERNALS or isinstance(value, torch.nn.Module):
                continue
            if isinstance(value, torch.Tensor):
                if _holdable(value, device):
                    yield (path, attr, NO_KEY), value
                continue
            for key, entry in _entries(value):
                if _holdable(entry, device):
                    yield (path, attr, key), entry


def slot_name(slot: HeldSlot) -> str:
    """``blocks.0.attn.attention_bias_cache['cpu']``: the state name of a held tensor."""
    path, attr, key = slot
    base = f"{path}.{attr}" if path else attr
    return base if key is NO_KEY else f"{base}[{key!r}]"


def owner_of(module: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return module.get_submodule(path) if path else module
    except AttributeError:
        return None


def read_slot(module: torch.nn.Module, slot: HeldSlot) -> torch.Tensor | None:
    """The tensor in the slot now, or None (the attribute, the entry or the module is gone, or
    holds no tensor)."""
    owner = owner_of(module, slot[0])
    return None if owner is None else read_in(vars(owner), slot)


def read_in(attributes: dict, slot: HeldSlot) -> torch.Tensor | None:
    """:func:`read_slot` from the owner's ``__dict__`` (the guard keeps it)."""
    _, attr, key = slot
    value: Any = attributes.get(attr)
    if key is not NO_KEY:
        if type(value) in (dict, OrderedDict):
            value = value.get(key)
        elif type(value) in (list, tuple) and isinstance(key, int) and key < len(value):
            value = value[key]
        else:
            return None
    return value if isinstance(value, torch.Tensor) else None


class HeldSwap:
    """Held slots filled with other tensors for a block, put back after. A slot the block
    assigned anew (``self.scale = ...``, ``self.cache[k] = ...``) keeps what the block put
    there: the trace's attribute-write check then sees the write (and restores), and an eager
    call leaves the module as PyTorch does."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.undo: list[tuple[dict, str, Any, Any]] = []  # owner's dict, attribute, original, put

    def put(self, slot: HeldSlot, value: torch.Tensor) -> None:
        owner = owner_of(self.module, slot[0])
        if owner is None:
            return
        attributes, (_, attr, key) = vars(owner), slot
        current: Any = attributes.get(attr)
        if key is NO_KEY:
            new: Any = value
        elif type(current) is tuple:
            new = current[:key] + (value,) + current[key + 1 :]
        else:  # a dict or list, written in place: the forward sees its own container
            self.undo.append((current, key, current[key], value))
            current[key] = value
            return
        self.undo.append((attributes, attr, current, new))
        attributes[attr] = new

    def restore(self) -> None:
        for holder, key, original, put in reversed(self.undo):
            try:
                still = holder[key] is put
            except (KeyError, IndexError):  # the block emptied the container: nothing to put back
                still = False
            if still:
                holder[key] = original
        self.undo.clear()
