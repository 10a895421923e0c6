"""Static analysis of PyTorch programs: shapes, memory and FLOPs without real memory.

Imports torch only, never TVM. ``profiling/`` answers what one call costs (fake tensors, FLOPs per
module, memory per node); ``memory/`` models a whole training step as a dataflow graph (simulator,
peak-memory operator ordering, and the keep-or-recompute min-cut). ``models`` is the model zoo the
tools, tests and benchmarks share. Public names are resolved lazily so that importing one tool
does not import all of them.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    # --- profiling: one call on fake tensors ---
    "MetaTensorMode": "analysis.profiling.meta",
    "symbolic_trace": "analysis.profiling.trace",
    "register_shape_impl": "analysis.profiling.trace",
    "MetaTraceError": "analysis.profiling.trace",
    "symbolic_profile": "analysis.profiling.profile",
    "profile_table": "analysis.profiling.table",
    "measure_saved_bytes": "analysis.profiling.profile",
    "NodeProfile": "analysis.profiling.profile",
    "ProfileSummary": "analysis.profiling.profile",
    "FlopCounter": "analysis.profiling.flops",
    "register_flop_formula": "analysis.profiling.flops",
    # --- memory: a training step as a dataflow graph ---
    "DataflowGraph": "analysis.memory.dataflow",
    "GraphError": "analysis.memory.dataflow",
    "import_training_step": "analysis.memory.importer",
    "import_eval_step": "analysis.memory.importer",
    "fx_to_dataflow": "analysis.memory.importer",
    "peak_memory": "analysis.memory.simulate",
    "MemoryProfile": "analysis.memory.simulate",
    "measure_fx_peak": "analysis.memory.simulate",
    "optimal_order": "analysis.memory.schedule",
    "ilp_order": "analysis.memory.schedule",
    "optimizer_rewrite": "analysis.memory.schedule",
    "ScheduleResult": "analysis.memory.schedule",
    "PartitionGraph": "analysis.memory.partition",
    "PartitionNode": "analysis.memory.partition",
    "min_cut": "analysis.memory.partition",
    "min_cut_with_budget": "analysis.memory.partition",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'analysis' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
