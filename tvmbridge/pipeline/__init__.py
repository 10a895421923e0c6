"""The compile: named stages (``stages``) over immutable artifacts (``artifacts``), run by one
small driver (``driver``) that checks what each stage reads and writes; ``compile`` runs them
for one signature, reusing an equal graph's compile."""

from .artifacts import Artifacts, Stage
from .compile import CompileResult, compile_result, graph_fingerprint
from .driver import run_stages
from .stages import STAGE_NAMES, STAGES

__all__ = [
    "Artifacts",
    "CompileResult",
    "STAGES",
    "STAGE_NAMES",
    "Stage",
    "compile_result",
    "graph_fingerprint",
    "run_stages",
]
