"""Errors that name the stage and, where there is one, the operator that failed.

Every failure inside the pipeline is re-raised as a :class:`ConversionError` so that a user sees
*what* could not be done and *where* (trace, convert, passes, gradient, split, build), instead of a
traceback deep inside TVM; ``add_tvm_dispatch(..., fallback=True)`` turns it into one warning and
keeps PyTorch.
"""
from __future__ import annotations


class ConversionError(RuntimeError):
    """A module or op could not be brought to TVM.

    Attributes:
        stage: pipeline stage that failed ("trace", "convert", "passes", "gradient", "split", "build",
            "inputs").
        op: the operator that caused it, when one is known (an aten overload or a Relax op name).
    """

    def __init__(self, stage: str, message: str, op: str | None = None) -> None:
        self.stage = stage
        self.op = op
        where = f"[{stage}]" + (f" op {op}:" if op else "")
        super().__init__(f"{where} {message}")


class UnsupportedOpError(ConversionError):
    """An operator has no converter or no gradient."""
