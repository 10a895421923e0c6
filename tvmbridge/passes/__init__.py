"""Relax-to-Relax passes before the split, one concern per module.

Order used by the pipeline (``tvmbridge.pipeline.STAGES``): random inputs, LayerNorm
decomposition, dedup, gradient (with the gradients Relax lacks registered), simplify. The pure
``IRModule -> IRModule`` ones are TVM pass objects (``ExternalizeRandom``,
``DecomposeForTraining``, ``Dedup``, ``Simplify``), so TVM's ``PassContext`` instruments work on
them; ``build_adjoint`` returns extra data and stays a function.
"""

from .dedup import Dedup
from .gradient import GradientResult, build_adjoint
from .layer_norm import DecomposeForTraining
from .random import ExternalizeRandom
from .simplify import DedupAndSimplify, Simplify

__all__ = [
    "DecomposeForTraining",
    "Dedup",
    "DedupAndSimplify",
    "ExternalizeRandom",
    "GradientResult",
    "Simplify",
    "build_adjoint",
]
