"""Static analysis of PyTorch programs: shapes, memory and FLOPs without real memory.

Imports torch only, never TVM. Public names are resolved lazily so that importing one tool
(for example the memory scheduler) does not import all of them.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    # --- meta profiler (issue 3) ---
    # "MetaTensorMode": "analysis.meta",
    # --- memory simulator / scheduler (issue 4) ---
    # "DataflowGraph": "analysis.dataflow",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'analysis' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
