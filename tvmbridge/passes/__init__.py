"""Relax-to-Relax passes before the split, one concern per module.

Order used by the pipeline (``tvmbridge.pipeline.STAGES``): dropout externalization, LayerNorm
decomposition, dedup, gradient (with the gradients Relax lacks registered), simplify. The pure
``IRModule -> IRModule`` ones are TVM pass objects (``ExternalizeDropout``,
``DecomposeForTraining``, ``Dedup``, ``Simplify``), so TVM's ``PassContext`` instruments work on
them; ``build_adjoint`` returns extra data and stays a function.
"""
from .dedup import Dedup
from .dropout import DropoutSite, ExternalizeDropout, dropout_sites
from .gradient import GradientResult, build_adjoint
from .layer_norm import DecomposeForTraining
from .simplify import Simplify

__all__ = [
    "DecomposeForTraining",
    "Dedup",
    "DropoutSite",
    "ExternalizeDropout",
    "GradientResult",
    "Simplify",
    "build_adjoint",
    "dropout_sites",
]
