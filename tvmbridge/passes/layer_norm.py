"""LayerNorm (and BatchNorm) decomposition for training.

Relax has no gradient for ``nn.layer_norm``; TVM's own ``DecomposeOpsForTraining`` rewrites it
into mean/variance/rsqrt arithmetic whose gradients Relax has (plus ``rsqrt``, registered in
``registered_gradients``).
"""
from __future__ import annotations

import tvm
from tvm import relax


def decompose_for_training(mod: tvm.IRModule, func_name: str = "main") -> tvm.IRModule:
    return relax.transform.DecomposeOpsForTraining(func_name)(mod)
