"""What a trace runs through that ``torch.export`` keeps no trace of: autograd behaviour set up
inside the forward.

``torch.export`` records the forward's tensor operations only. A custom ``torch.autograd.Function``
is inlined as its forward, its backward dropped, so the bridge would differentiate the forward
itself: a straight-through estimator's gradient, a gradient-reversal layer's, any hand-written
backward would silently become the forward's true gradient. A gradient hook registered on an
intermediate tensor (``h.register_hook(fn)``: gradient reversal, clipping or masking by hook,
Grad-CAM's capture) never runs, and ``h.retain_grad()`` never fills ``h.grad``. While the bridge
traces, ``Function.apply``, ``Tensor.register_hook`` and ``Tensor.retain_grad`` note what the
tracing thread runs (other threads pass through untouched); the patches are undone when the last
trace ends, and the trace is refused with what to do.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import Function
from torch.utils.checkpoint import CheckpointFunction

from .trace_patches import ScopedPatch

# the Functions torch.library generates for a custom op's registered backward: the trace keeps the
# op itself as a node (not its forward's ops), so a converter for it, or the refusal of an op
# without one, decides; nothing is differentiated in its place
_LIBRARY_AUTOGRAD = "torch._library.autograd"
_local = threading.local()


@dataclass
class UntracedAutograd:
    """What one trace ran that its export does not keep."""

    functions: list[type] = field(default_factory=list)  # custom Functions with their own backward
    hooks: list[str] = field(default_factory=list)  # the Tensor methods called: register_hook, retain_grad

    def extend(self, other: UntracedAutograd) -> None:
        self.functions.extend(other.functions)
        self.hooks.extend(other.hooks)

    def refusal(self, module_name: str) -> str | None:
        """Why the trace cannot stand for the forward, and what to do; None if nothing was seen."""
        if self.functions:
            names = ", ".join(sorted({c.__qualname__ for c in self.functions}))
            return (
                f"{module_name}'s forward applies a custom autograd.Function ({names}) whose own backward "
                "TVM cannot run: its gradient would become the gradient of its forward. Use "
                "torch.compile(model, backend='tvmbridge'), which runs it in PyTorch and the rest on TVM; or "
                "dispatch the submodules around it; or keep PyTorch for this module (fallback=True)"
            )
        if self.hooks:
            called = ", ".join(f"Tensor.{h}" for h in sorted(set(self.hooks)))
            return (
                f"{module_name}'s forward sets up gradient handling on an intermediate tensor ({called}), which "
                "compiled code does not run: a hook's change to the gradient would be lost, a retained .grad "
                "never filled. Register the hook outside the dispatched module (on its output, an input or a "
                "parameter: those run), use torch.compile(model, backend='tvmbridge'), which keeps it in "
                "PyTorch, or keep PyTorch for this module (fallback=True)"
            )
        return None


def _recording_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``Function.apply``, noting the class where this thread traces. Reentrant checkpointing
    (``CheckpointFunction(run_function, preserve_rng_state, *args)``, transformers' default for
    gradient checkpointing) is traced as the function it wraps: its backward is that function's
    gradient, and the forward it runs under ``no_grad`` would otherwise read as a no_grad block."""
    seen: UntracedAutograd | None = getattr(_local, "seen", None)
    if seen is not None and issubclass(cls, CheckpointFunction):
        return args[0](*args[2:])
    if seen is not None and cls.__module__ != _LIBRARY_AUTOGRAD:
        seen.functions.append(cls)
    return _APPLY.original.__func__(cls, *args, **kwargs)


def _noting(name: str) -> Any:
    """``Tensor.<name>``, noting the call where this thread traces."""
    original = getattr(torch.Tensor, name)  # as this module is imported: before any patch

    def noted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen: UntracedAutograd | None = getattr(_local, "seen", None)
        if seen is not None:
            seen.hooks.append(name)
        return original(self, *args, **kwargs)

    return noted


_APPLY = ScopedPatch(Function, "apply", classmethod(_recording_apply))
_PATCHES = (_APPLY, *(ScopedPatch(torch.Tensor, n, _noting(n)) for n in ("register_hook", "retain_grad")))


@contextlib.contextmanager
def untraced_autograd_seen() -> Iterator[UntracedAutograd]:
    """What this thread's forward sets up meanwhile that the export will not keep."""
    for patch in _PATCHES:
        patch.enter()
    # a trace inside a trace: the outer one keeps recording after
    outer: UntracedAutograd | None = getattr(_local, "seen", None)
    seen = UntracedAutograd()
    _local.seen = seen
    try:
        yield seen
    finally:
        if outer is not None:
            outer.extend(seen)
        _local.seen = outer
        for patch in reversed(_PATCHES):
            patch.exit()
