"""The process's caches, in one object: bounded, locked, and cleared in one place.

Each cache is a :class:`BoundedCache` (least recently used entry out first). ``CACHES`` is the
only module-level mutable state of the bridge besides its registries (``tests/test_layout.py``
checks that): compiles by graph fingerprint (identical layers share one executable) and tuning
databases read from disk.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

V = TypeVar("V")


class BoundedCache(Generic[V]):
    """A least-recently-used map of at most ``limit`` entries, safe to share between threads."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a cache holds at least one entry, not {limit}")
        self.limit = limit
        self.hits = 0
        self._entries: collections.OrderedDict[Hashable, V] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return value

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], V | None]) -> V | None:
        """The entry, else ``make()``, kept unless None. Made under the lock, so threads asking
        together make it once (for values made in moments, as reading a tuning database; a
        compile uses ``get`` and ``put``)."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                return value
            value = make()
            if value is not None:
                self._entries[key] = value
                while len(self._entries) > self.limit:
                    self._entries.popitem(last=False)
            return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = 0


@dataclass(frozen=True)
class ProcessCaches:
    """Every cache the bridge keeps for the life of the process."""

    compiles: BoundedCache = field(default_factory=lambda: BoundedCache(16))  # fingerprint -> CompileResult
    tuning_records: BoundedCache = field(default_factory=lambda: BoundedCache(4))  # (db, target) -> records
    backends: BoundedCache = field(default_factory=lambda: BoundedCache(8))  # torch.compile options -> Backend

    def clear(self) -> None:
        """Forget every compile and record (a later call compiles again)."""
        self.compiles.clear()
        self.tuning_records.clear()


CACHES = ProcessCaches()
