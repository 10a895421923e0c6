"""Relax passes of the bridge, one concern per module.

Order used by the pipeline (``tvmbridge.pipeline``): dropout externalization, LayerNorm
decomposition, dedup, gradient (with the gradients Relax lacks registered), simplify.
"""
from .dedup import dedup
from .dropout import DropoutSite, externalize_dropout
from .gradient import GradientResult, build_adjoint
from .layer_norm import decompose_for_training
from .simplify import simplify

__all__ = [
    "DropoutSite",
    "GradientResult",
    "build_adjoint",
    "decompose_for_training",
    "dedup",
    "externalize_dropout",
    "simplify",
]
