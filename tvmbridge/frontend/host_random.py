"""Random numbers a forward draws outside PyTorch, which a trace would freeze.

``torch.rand`` in a forward becomes an op of the traced program (the bridge draws it per call from
PyTorch's generator). A draw from Python's ``random`` or numpy's global generator is a plain value
while the forward is traced: compiled code would repeat the trace's draw at every call. transformers
does this in training: wav2vec2's adapter LayerDrop (``np.random.random()``) and its SpecAugment
masks (``np.random.rand``, ``np.random.choice``), which would drop the same layers and mask the
same frames at every step, for good.

:func:`host_random_seen` snapshots both generators around the trace, restores them after (the
trace draws nothing from the user's streams), and says which ones the forward drew from.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any


class HostRandom:
    """The generators a traced forward drew from (``drew``: their names)."""

    def __init__(self) -> None:
        self.drew: list[str] = []

    def refusal(self, module_name: str) -> str | None:
        """What to tell the user when the forward drew, or None."""
        if not self.drew:
            return None
        which = " and ".join(self.drew)
        return (
            f"{module_name}'s forward draws random numbers from {which} while it is traced: compiled code "
            "would repeat the trace's draw at every call (the same layers dropped, the same positions "
            "masked, for good). Draw them with torch instead (torch.rand and the like: compiled code draws "
            "those per call from PyTorch's generator), turn them off (transformers' wav2vec2-style models: "
            "mask_time_prob=0, mask_feature_prob=0, layerdrop=0), or pass fallback=True: PyTorch then runs "
            "this module's own code and its submodules compile by themselves"
        )


def _numpy_state() -> Any:
    numpy = sys.modules.get("numpy")  # a forward that draws from numpy has imported it
    return None if numpy is None else numpy.random.get_state()


def _numpy_same(before: Any, after: Any) -> bool:
    numpy = sys.modules["numpy"]
    return all(
        numpy.array_equal(a, b) if isinstance(a, numpy.ndarray) else a == b for a, b in zip(before, after, strict=True)
    )


@contextlib.contextmanager
def host_random_seen() -> Iterator[HostRandom]:
    """Python's and numpy's global generators as they were before the block, after it; what the
    block drew from (by comparing their states)."""
    seen = HostRandom()
    python_before, numpy_before = random.getstate(), _numpy_state()
    try:
        yield seen
    finally:
        if random.getstate() != python_before:
            seen.drew.append("Python's random module")
            random.setstate(python_before)
        # numpy imported by the forward itself: its generator is fresh, nothing to compare with
        if numpy_before is not None and not _numpy_same(numpy_before, _numpy_state()):
            seen.drew.append("numpy's global generator (np.random)")
            sys.modules["numpy"].random.set_state(numpy_before)
