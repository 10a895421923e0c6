"""Python's cyclic garbage collector kept off the objects that existed before a compile.

A compile allocates hundreds of thousands of Python objects (FX nodes, fake tensors, IR
wrappers), and each of CPython's full collections it triggers walks every object the process
holds: torch's, transformers', the model's, the user's. On a process with a model loaded those
walks are a tenth of a cold compile and a third of a warm one (the export that a disk-cache load
still runs). ``gc.freeze`` moves the objects alive at the compile's start out of the collector's
sight for its duration, and ``gc.unfreeze`` gives them back after: collections still run and
free the compile's own cyclic garbage, nothing the process held before is freed later than it
would have been by more than the compile's length, and the process's collector is as it was.

Left alone when the collector is off (the caller's choice) or objects are already frozen (the
caller's ``gc.freeze``, which ``unfreeze`` would undo). Nested and concurrent compiles share one
freeze: the first to enter takes it, the last to leave gives it back.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_state = {"depth": 0, "froze": False}


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """The block runs with the objects alive at its start frozen (see the module)."""
    with _LOCK:
        if _state["depth"] == 0:
            _state["froze"] = gc.isenabled() and gc.get_freeze_count() == 0
            if _state["froze"]:
                gc.freeze()
        _state["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _state["depth"] -= 1
            if _state["depth"] == 0 and _state["froze"]:
                _state["froze"] = False
                gc.unfreeze()
