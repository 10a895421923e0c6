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
    "MetaTensorMode": "analysis.meta",
    "symbolic_trace": "analysis.trace",
    "register_shape_impl": "analysis.trace",
    "MetaTraceError": "analysis.trace",
    "symbolic_profile": "analysis.profile",
    "profile_table": "analysis.profile",
    "measure_saved_bytes": "analysis.profile",
    "NodeProfile": "analysis.profile",
    "ProfileSummary": "analysis.profile",
    "FlopCounter": "analysis.flops",
    "register_flop_formula": "analysis.flops",
    # --- memory simulator / scheduler (issue 4) ---
    "DataflowGraph": "analysis.dataflow",
    "GraphError": "analysis.dataflow",
    "import_training_step": "analysis.importer",
    "import_eval_step": "analysis.importer",
    "fx_to_dataflow": "analysis.importer",
    "peak_memory": "analysis.simulate",  # (not "simulate": it would clash with the module)
    "MemoryProfile": "analysis.simulate",
    "measure_fx_peak": "analysis.simulate",
    "optimal_order": "analysis.schedule",
    "ilp_order": "analysis.schedule",
    "optimizer_rewrite": "analysis.schedule",
    "ScheduleResult": "analysis.schedule",
    # --- capture set: min-cut partition (issue 5) ---
    "PartitionGraph": "analysis.partition",
    "PartitionNode": "analysis.partition",
    "min_cut": "analysis.partition",
    "min_cut_with_budget": "analysis.partition",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'analysis' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
