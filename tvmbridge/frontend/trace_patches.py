"""Library functions replaced while the bridge traces, and put back when the last trace ends.

A trace sees what PyTorch's Python code does, including choices that read tensor values (which
``torch.export`` cannot trace) or record nothing (a custom Function's own backward). Where the
bridge must see or decide differently, it replaces the function process-wide while at least one
trace runs; the replacement acts only in the threads that trace (a thread-local flag the
replacement reads) and passes every other call to the original.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class ScopedPatch:
    """``owner.name`` set to ``patched`` while at least one trace (of any thread) runs."""

    def __init__(self, owner: Any, name: str, patched: Any) -> None:
        self.owner, self.name, self.patched = owner, name, patched
        self.own = name in owner.__dict__  # else inherited (a C base's method): shadowed, then unshadowed
        # as defined (a classmethod object stays one), or as inherited
        self.original = owner.__dict__[name] if self.own else getattr(owner, name)
        self.lock = threading.Lock()
        self.active = 0
        self.local = threading.local()  # how many scopes this thread is in

    @property
    def here(self) -> bool:
        """Whether this thread is inside :meth:`scope` (the replacement acts only then)."""
        return getattr(self.local, "depth", 0) > 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The block (a trace in this thread) runs with the replacement installed and acting."""
        self.enter()
        self.local.depth = getattr(self.local, "depth", 0) + 1
        try:
            yield
        finally:
            self.local.depth -= 1
            self.exit()

    def enter(self) -> None:
        """One more trace running: the first installs the replacement."""
        with self.lock:
            if self.active == 0:
                setattr(self.owner, self.name, self.patched)
            self.active += 1

    def exit(self) -> None:
        """One trace fewer: the last puts the original back."""
        with self.lock:
            self.active -= 1
            if self.active == 0:
                if self.own:
                    setattr(self.owner, self.name, self.original)
                else:
                    delattr(self.owner, self.name)
