"""The lock between dispatched calls and tracing.

While ``torch.export`` traces, it patches ``nn.Module.__call__`` for the whole process and the
trace (``call_state.swapped_state``) swaps the module's tensors for fake ones: a call in another
thread would run inside the tracer or read fake parameters. So compiles (and the eager re-run of a double
backward) take :data:`TRACING` for writing, calls read the module's state under it for reading,
and a call that is about to run PyTorch's forward first waits for any trace in another thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class ReadWriteLock:
    """Many readers or one writer; a waiting writer holds new readers back (no starvation).
    A thread that holds the write lock may read (a traced forward calling the module)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer: int | None = None
        self._writers_waiting = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._writer == me:
            yield
            return
        with self._cond:
            while self._writer is not None or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    def wait_idle(self) -> None:
        """Return once no other thread holds the write lock."""
        me = threading.get_ident()
        with self._cond:
            while self._writer not in (None, me):
                self._cond.wait()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._writer == me:
            yield
            return
        with self._cond:
            self._writers_waiting += 1
            while self._writer is not None or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = me
        try:
            yield
        finally:
            with self._cond:
                self._writer = None
                self._cond.notify_all()


TRACING = ReadWriteLock()  # one for the process: the patches torch.export makes are process-wide
