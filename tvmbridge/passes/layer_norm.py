"""LayerNorm (and BatchNorm) decomposition for training.

Relax has no gradient for ``nn.layer_norm``; TVM's own ``DecomposeOpsForTraining`` rewrites it
into mean/variance/rsqrt arithmetic whose gradients Relax has (plus ``rsqrt``, registered in
``gradients``).
"""
from __future__ import annotations

import tvm
from tvm import relax

from .. import names


def DecomposeForTraining() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    return relax.transform.DecomposeOpsForTraining(names.MAIN)
