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
from collections.abc import Iterator
from typing import Any

from torch.autograd.function import Function
from torch.utils.checkpoint import CheckpointFunction

from .trace_patches import ScopedPatch

# the Functions torch.library generates for a custom op's registered backward: the trace keeps the
# op itself as a node (not its forward's ops), so a converter for it, or the refusal of an op
# without one, decides; nothing is differentiated in its place
_LIBRARY_AUTOGRAD = "torch._library.autograd"
_local = threading.local()


def _recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply``, noting the class where this thread traces. Reentrant checkpointing
    (``CheckpointFunction(run_function, preserve_rng_state, *args)``, transformers' default for
    gradient checkpointing) is traced as the function it wraps: its backward is that function's
    gradient, and the forward it runs under ``no_grad`` would otherwise read as a no_grad block."""
    seen = getattr(_local, "seen", None)
    if seen is not None and issubclass(cls, CheckpointFunction):
        return args[0](*args[2:])
    if seen is not None and cls.__module__ != _LIBRARY_AUTOGRAD:
        seen.append(cls)
    return _PATCH.original.__func__(cls, *args, **kwargs)


_PATCH = ScopedPatch(Function, "apply", classmethod(_recording_apply))


@contextlib.contextmanager
def custom_functions_seen() -> Iterator[list[type]]:
    """A list that fills with the custom Functions (own backward) this thread applies meanwhile."""
    _PATCH.enter()
    outer = getattr(_local, "seen", None)  # a trace inside a trace: the outer one keeps recording after
    seen: list[type] = []
    _local.seen = seen
    try:
        yield seen
    finally:
        if outer is not None:
            outer.extend(seen)
        _local.seen = outer
        _PATCH.exit()
