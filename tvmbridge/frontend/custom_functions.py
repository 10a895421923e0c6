"""Which custom ``torch.autograd.Function``s a trace ran through.

``torch.export`` inlines a custom Function's forward and keeps no trace of its backward, so the
bridge would differentiate the forward itself: a straight-through estimator's gradient, a
gradient-reversal layer's, any hand-written backward would silently become the forward's true
gradient. While the bridge traces, ``Function.apply`` records the classes applied in the tracing
thread (other threads pass through untouched); the patch is undone when the last trace ends.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from torch.autograd.function import Function
from torch.utils.checkpoint import CheckpointFunction

# Functions whose backward is the gradient of their forward (reentrant checkpointing recomputes it)
TRUE_GRADIENT: tuple[type, ...] = (CheckpointFunction,)

_ORIGINAL_APPLY = Function.__dict__["apply"]
_local = threading.local()


def _recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    seen = getattr(_local, "seen", None)
    if seen is not None and not issubclass(cls, TRUE_GRADIENT):
        seen.append(cls)
    return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)


class _Patch:
    """``Function.apply`` recording while at least one trace (of any thread) is running."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0

    def enter(self) -> None:
        with self.lock:
            if self.active == 0:
                Function.apply = classmethod(_recording_apply)
            self.active += 1

    def exit(self) -> None:
        with self.lock:
            self.active -= 1
            if self.active == 0:
                Function.apply = _ORIGINAL_APPLY


_PATCH = _Patch()


@contextlib.contextmanager
def custom_functions_seen() -> Iterator[list[type]]:
    """A list that fills with the custom Functions (own backward) this thread applies meanwhile."""
    _PATCH.enter()
    _local.seen = seen = []
    try:
        yield seen
    finally:
        _local.seen = None
        _PATCH.exit()
