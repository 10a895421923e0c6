"""LayerNorm (and BatchNorm) decomposition for training, and small integer powers.

Relax has no gradient for ``nn.layer_norm``; TVM's own ``DecomposeOpsForTraining`` rewrites it
into mean/variance/rsqrt arithmetic whose gradients Relax has (plus ``rsqrt``, registered in
``gradients``). ``power`` by 2, 3 or 4 becomes multiplications here too (``powers``), before
the gradient, so that neither half computes a ``pow``.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .. import names
from .powers import IntegerPowers


def DecomposeForTraining() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    return tvm.transform.Sequential([relax.transform.DecomposeOpsForTraining(names.MAIN), IntegerPowers()])
