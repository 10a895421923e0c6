"""The process's caches, in one object: bounded, locked, and cleared in one place.

Each cache is a :class:`BoundedCache` (least recently used entry out first). ``CACHES`` is the
only module-level mutable state of the bridge besides its registries (``tests/test_layout.py``
checks that): compiles by graph fingerprint (identical layers share one executable), tuning
databases read from disk, and the disk caches' writes still running behind their callers.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
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


class WriteBehind:
    """Work run behind the caller, in order, in one thread (the disk caches' writes, so that a
    compile need not wait for them), waited for by key (a cache directory). The thread is made on
    first use and joined at interpreter exit (``concurrent.futures`` joins its workers), so a
    process that ends right after submitting still finishes the work."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[Hashable, list[Future]] = {}
        self._inside = threading.local()

    def submit(self, key: Hashable, work: Callable[[], object]) -> None:
        def run() -> object:
            self._inside.active = True
            return work()

        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tvmbridge-cache-writer")
            future = self._pool.submit(run)
            self._pending[key] = [f for f in self._pending.get(key, []) if not f.done()] + [future]

    def wait(self, key: Hashable | None = None) -> None:
        """Block until the work submitted under ``key`` (every key: None) is done (its own errors
        are the work's to report). In the writer thread itself nothing is waited for: the work
        before the running one is done (one thread, in order), and the running one is the caller."""
        if getattr(self._inside, "active", False):
            return
        with self._lock:
            keys = list(self._pending) if key is None else [key]
            futures = [f for k in keys for f in self._pending.get(k, [])]
        for future in futures:
            future.result()
        with self._lock:  # done ones forgotten (kept until now: a second waiter waits for them too)
            for k in list(self._pending):
                left = [f for f in self._pending[k] if not f.done()]
                if left:
                    self._pending[k] = left
                else:
                    del self._pending[k]

    def forget(self) -> None:
        """In a forked child (a DataLoader worker): no writer thread there; the parent finishes
        what it submitted."""
        self._lock = threading.Lock()
        self._pool = None
        self._pending = {}


@dataclass(frozen=True)
class ProcessCaches:
    """Every cache the bridge keeps for the life of the process."""

    compiles: BoundedCache = field(default_factory=lambda: BoundedCache(16))  # fingerprint -> CompileResult
    tuning_records: BoundedCache = field(default_factory=lambda: BoundedCache(4))  # (db, target) -> records
    backends: BoundedCache = field(default_factory=lambda: BoundedCache(8))  # torch.compile options -> Backend
    writes: WriteBehind = field(default_factory=WriteBehind)  # the disk caches' writes, by directory

    def clear(self) -> None:
        """Forget every compile and record (a later call compiles again)."""
        self.compiles.clear()
        self.tuning_records.clear()


CACHES = ProcessCaches()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=CACHES.writes.forget)
