"""The bridge's errors: every failure names the stage and, where there is one, the operator.

Every failure inside a compile becomes a :class:`ConversionError` (through :func:`stage_errors`,
which the pipeline driver wraps around each stage), so that a user sees *what* could not be done
and *where* instead of a traceback deep inside TVM, and ``add_tvm_dispatch(..., fallback=True)``
can keep PyTorch for any compile failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import FrameType


class ConversionError(RuntimeError):
    """A module or op could not be brought to TVM.

    Attributes:
        stage: the pipeline stage that failed (a name from ``tvmbridge.pipeline.STAGES``, or
            "inputs" for a sample call the bridge refuses up front).
        op: the operator that caused it, when one is known (an aten overload or a Relax op name).
        sources: the nodes of the program as it was handed over (the module's code, or the graph
            dynamo captured) that the failing ops came from, when known: where a caller can cut the
            program so that PyTorch runs those and TVM the rest.
    """

    def __init__(self, stage: str, message: str, op: str | None = None, sources: tuple[str, ...] = ()) -> None:
        self.stage = stage
        self.op = op
        self.sources = sources
        self.message = message
        where = f"[{stage}]" + (f" op {op}:" if op else "")
        super().__init__(f"{where} {message}")


class UnsupportedOpError(ConversionError):
    """An operator has no converter or no gradient."""


def listed_names(names: list[str], most: int = 4) -> str:
    """The first ``most`` names, then ``...`` where there are more: how messages name attributes."""
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


class AttributeWriteError(ConversionError):
    """The traced forward assigned module attributes (a counter, a cache filled on first use),
    which compiled code would not do. The trace's assignments are undone; PyTorch runs the call
    and the next call is traced again from the state it leaves (a cache, once filled, is read)."""

    def __init__(self, names: list[str], every_call: bool = False, hint: str = "") -> None:
        self.names, self.hint = names, hint
        shown = listed_names(names)
        if every_call:
            message = (
                f"forward assigns module attributes on every call ({shown}), which compiled code would not: "
                "keep such a value in a buffer (register_buffer: the compiled code updates it) or outside "
                "forward, or pass fallback=True to keep PyTorch"
            )
        else:
            message = (
                f"forward assigns module attributes ({shown}), which compiled code would not: PyTorch runs "
                "this call and the next is traced from the state it leaves"
            )
        super().__init__("trace", f"{message} ({hint})" if hint else message)


def module_name(module: object) -> str:
    """How warnings name a dispatched module: its class, or what it says it is (a torch.compile
    graph names the user's line that made it)."""
    return getattr(module, "_tvmbridge_description", None) or type(module).__name__


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``: enough to name a failure without TVM's backtrace."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@contextlib.contextmanager
def stage_errors(
    stage: str, op: str | None = None, what: str = "", error: type[ConversionError] = ConversionError
) -> Iterator[None]:
    """Re-raise any exception of the block as an ``error`` of ``stage`` (naming ``op`` when
    given). A ``ConversionError`` raised inside keeps its own stage and op."""
    try:
        yield
    except ConversionError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch and TVM raise many types
        prefix = f"{what}: " if what else ""
        raise error(stage, prefix + describe(exc), op=op) from exc


class FallbackWarning(UserWarning):
    """A call ran PyTorch instead of the compiled code; the message says why. Filter this class
    (or pass ``warn_on_fallback=False``) to silence it."""


class VerificationWarning(FallbackWarning):
    """A compiled variant disagreed with PyTorch on its first call (or failed while running): it
    was discarded and that call signature runs PyTorch from then on; the message names the worst
    tensor. Please report it: it is a bug of the bridge. Also: a call too ill-conditioned to check
    the variant's gradients (that backward used PyTorch's; a later call is checked), or a
    variant discarded after several such calls; the message says which."""


class RecompileWarning(UserWarning):
    """A call compiled another variant because its arguments differ in kind from the sample's (a
    keyword given or left out, another positional count), as when a parent module passes extra
    keywords: the message names the difference, so the sample can be the caller's call."""


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside torch and tvmbridge."""
    import torch

    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level
