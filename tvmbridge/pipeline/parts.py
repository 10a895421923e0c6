"""The compiled code in two parts, each built when a call first needs it.

A variant's calls either train (``forward`` then ``backward``) or only infer (``forward_infer``:
no_grad calls, nothing kept for a backward). Most variants only ever run one kind: a train-mode
variant trains, an eval-mode variant under ``no_grad`` infers. Lowering and code generation are
most of a cold compile and scale with the kernels built, and the inference function's kernels
differ from the forward's (nothing captured, other fusions), so the compile builds the part its
first call needs and the other is built by the first call that needs it (as ``torch.compile``
compiles a no_grad graph when it first sees one). Each part is its own executable in the disk
cache.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import tvm
from tvm import relax

from .. import names
from .collector import older_objects_frozen

TRAIN = "train"
INFER = "infer"
FUNCTIONS: dict[str, tuple[str, ...]] = {TRAIN: (names.FORWARD, names.BACKWARD), INFER: (names.FORWARD_INFER,)}
PART_OF: dict[str, str] = {f: part for part, functions in FUNCTIONS.items() for f in functions}

# (the part's module, its disk-cache key or "") -> (executable, loaded from the disk cache, key)
Builder = Callable[[tvm.IRModule, str], tuple[tvm.runtime.Executable, bool, str]]


def part_module(halves: tvm.IRModule, part: str) -> tvm.IRModule:
    """``halves`` with only ``part``'s Relax functions (kernels and module attributes kept)."""
    keep = FUNCTIONS[part]
    functions = {
        gv: f for gv, f in halves.functions_items() if not isinstance(f, relax.Function) or gv.name_hint in keep
    }
    return tvm.IRModule(functions, attrs=halves.attrs, global_infos=halves.global_infos)


class Parts:
    """The executables of one compile by part: built once each, on first need, under a lock
    (two threads wanting a part at once build it once)."""

    def __init__(self, halves: tvm.IRModule, build: Builder, keys: dict[str, str] | None = None) -> None:
        self._halves = halves
        self._build = build
        self._lock = threading.Lock()
        self._built: dict[str, tvm.runtime.Executable] = {}
        self.keys: dict[str, str] = dict(keys or {})  # part -> its executable's disk-cache key
        self.loaded: dict[str, bool] = {}  # part -> loaded from the disk cache instead of built
        self.seconds: dict[str, float] = {}  # part -> seconds its build (or load) took

    def get(self, part: str) -> tvm.runtime.Executable:
        """``part``'s executable, built now if no call needed it before."""
        exe = self._built.get(part)
        if exe is not None:
            return exe
        with self._lock, older_objects_frozen():
            if part not in self._built:
                start = time.perf_counter()
                exe, loaded, key = self._build(part_module(self._halves, part), self.keys.get(part, ""))
                self.keys[part], self.loaded[part] = key, loaded
                self.seconds[part] = time.perf_counter() - start
                self._built[part] = exe
            return self._built[part]

    def built(self, part: str) -> bool:
        return part in self._built
