"""Which attributes of which modules a trace read, so that the state guard checks only those.

A compiled graph depends on the attributes its forward read while tracing, and on no other: a
step counter the training loop keeps on the model (``model.global_step = i``), a framework's
bookkeeping on the module, change every call and, checked, would trace every call again. This
records reads the way dynamo's guards come from what its bytecode analysis saw: for the block,
each module instance's class is a same-named subclass whose ``__getattribute__`` notes the name
(also a name that is missing: ``getattr(self, "scale", None)`` reads ``scale``), then the class
is put back. Reading the whole ``__dict__`` (``vars(self)``, a copy) counts as reading every
attribute; a module whose class cannot be swapped (a metaclass that refuses) is unrecorded, and
all its attributes stay checked. ``object.__getattribute__(module, name)`` bypasses the record:
code that reads a module's attributes that way is not supported.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

# names whose read hands out every attribute at once
WHOLE_STATE = frozenset({"__dict__", "__getstate__", "__reduce__", "__reduce_ex__"})

# nn.Module's own lookups: they read ``__dict__`` for the one name asked (a parameter, a submodule)
_MODULE_LOOKUPS = frozenset(f.__code__ for f in (nn.Module.__getattr__, nn.Module.__setattr__, nn.Module.__delattr__))


def _note(self: object, name: str) -> None:
    sets = SWAPS.open.get(id(self))
    if not sets or (name in WHOLE_STATE and sys._getframe(2).f_code in _MODULE_LOOKUPS):
        return
    for names in sets:
        names.add(name)


def _recording_class(cls: type) -> type | None:
    """``cls`` with a ``__getattribute__`` that notes each name read; None where the metaclass
    refuses a subclass. Made per recording, not kept: a kept one would keep ``cls`` alive."""
    read = cls.__getattribute__

    def __getattribute__(self: object, name: str) -> Any:  # noqa: N807 - the slot's own name
        _note(self, name)
        return read(self, name)  # type: ignore[call-arg, arg-type]  # the class's own slot, unbound

    namespace = {
        "__getattribute__": __getattribute__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,  # what export writes into a node's module stack
        "__doc__": cls.__doc__,
    }
    try:
        return type(cls)(cls.__name__, (cls,), namespace)
    except Exception:  # noqa: BLE001 - a metaclass or __init_subclass__ with demands of its own
        return None


class ReadLog:
    """The names read per module instance (by id) in one or more recorded blocks."""

    def __init__(self) -> None:
        self.names: dict[int, set[str]] = {}
        self.unrecorded: set[int] = set()

    def merge(self, other: ReadLog) -> None:
        for key, names in other.names.items():
            self.names.setdefault(key, set()).update(names)
        self.unrecorded |= other.unrecorded

    def frozen(self) -> AttributeReads:
        """Per module id the names read; a module absent (unrecorded, or its whole state read)
        has every attribute taken as read."""
        return {
            key: frozenset(names)
            for key, names in self.names.items()
            if key not in self.unrecorded and WHOLE_STATE.isdisjoint(names)
        }


AttributeReads = Mapping[int, frozenset[str]]


class _Swaps:
    """The modules whose class is swapped now, and the recordings open on each (nested ones, or
    two threads tracing one module, share a swap: the last to close puts the class back)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: dict[int, list[set[str]]] = {}  # id of a module -> the name sets of its recordings
        self.swapped: dict[int, tuple[type, type, int]] = {}  # id -> (own class, recording class, holders)

    def swap_in(self, module: torch.nn.Module, names: set[str], made: dict[type, type | None]) -> bool:
        key, cls = id(module), type(module)
        if key in self.swapped:
            own, recording, count = self.swapped[key]
            self.swapped[key] = (own, recording, count + 1)
        else:
            if cls not in made:
                made[cls] = _recording_class(cls)
            found = made[cls]
            if found is None:
                return False
            try:
                module.__class__ = found
            except TypeError:  # an instance layout the subclass does not share
                return False
            self.swapped[key] = (cls, found, 1)
        self.open.setdefault(key, []).append(names)
        return True

    def swap_out(self, module: torch.nn.Module, names: set[str]) -> None:
        key = id(module)
        sets = [s for s in self.open.get(key, []) if s is not names]
        if sets:
            self.open[key] = sets
        else:
            self.open.pop(key, None)
        own, recording, count = self.swapped.pop(key)
        if count > 1:
            self.swapped[key] = (own, recording, count - 1)
        elif type(module) is recording:  # else the block set a class of its own: it stays
            module.__class__ = own


SWAPS = _Swaps()


@contextlib.contextmanager
def recorded_reads(module: torch.nn.Module, log: ReadLog) -> Iterator[ReadLog]:
    """The block's attribute reads on ``module`` and its submodules, added to ``log``; every
    class restored after, however the block ends."""
    swapped: list[tuple[torch.nn.Module, set[str]]] = []
    made: dict[type, type | None] = {}
    with SWAPS.lock:
        for m in module.modules():
            names = log.names.setdefault(id(m), set())
            if SWAPS.swap_in(m, names, made):
                swapped.append((m, names))
            else:
                log.unrecorded.add(id(m))
    try:
        yield log
    finally:
        with SWAPS.lock:
            for m, names in swapped:
                SWAPS.swap_out(m, names)
