"""Where ``F.interpolate`` reads from, per axis, exactly as ATen's CPU kernels compute it.

Relax's ``image.resize2d`` (what TVM's frontend makes of ``upsample_*``) rounds nearest
coordinates with ``half_pixel`` where PyTorch floors ``dst * scale``, and ignores the scale factor
the caller gave (PyTorch uses ``1/scale_factor``, not ``in/out``): a different picture. The bridge
converts interpolation itself, axis by axis, as gathers (``take``) at these indices and, for linear
modes, a weighted sum of two gathers; the gradients are then ``take``'s, exact scatter-adds.
The arithmetic below follows ``aten/src/ATen/native/UpSample.h`` in the dtype ATen uses (float
for nearest; the input's opmath type for linear).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def source_scale(in_size: int, out_size: int, align_corners: bool, scale: float | None, dtype: str) -> np.generic:
    """``area_pixel_compute_scale``: ``(in-1)/(out-1)`` with aligned corners, else ``1/scale``
    where a scale factor was given, else ``in/out``."""
    t = np.dtype(dtype).type
    if align_corners:
        return t(in_size - 1) / t(out_size - 1) if out_size > 1 else t(0)
    if scale is not None and scale > 0:
        return t(1.0 / scale)
    return t(in_size) / t(out_size)


def nearest_indices(in_size: int, out_size: int, scale: float | None, exact: bool = False) -> np.ndarray:
    """``nearest_idx`` (``exact``: ``nearest_neighbor_exact_compute_source_index``), in float."""
    if out_size == in_size and not exact:
        return np.arange(out_size, dtype="int64")
    if out_size == 2 * in_size and not exact:
        return np.arange(out_size, dtype="int64") >> 1
    s = source_scale(in_size, out_size, False, scale, "float32")
    dst = np.arange(out_size, dtype="float32")
    src = np.floor((dst + np.float32(0.5)) * s if exact else dst * s)
    return np.minimum(src.astype("int64"), in_size - 1)


@dataclass(frozen=True)
class LinearTaps:
    """Per output index: the two source indices and their weights (``out = l0*x[i0] + l1*x[i1]``)."""

    i0: np.ndarray
    i1: np.ndarray
    l0: np.ndarray
    l1: np.ndarray


def linear_taps(in_size: int, out_size: int, align_corners: bool, scale: float | None, dtype: str) -> LinearTaps | None:
    """``compute_source_index_and_lambda`` for every output index; ``None`` where the axis keeps
    its size (ATen then copies)."""
    if out_size == in_size:
        return None
    t = np.dtype(dtype).type
    ratio = source_scale(in_size, out_size, align_corners, scale, dtype)
    dst = np.arange(out_size).astype(dtype)
    real = ratio * dst if align_corners else ratio * (dst + t(0.5)) - t(0.5)
    if not align_corners:
        real = np.maximum(real, t(0))
    i0 = np.minimum(np.floor(real.astype("float32")).astype("int64"), in_size - 1)  # floorf, as ATen
    l1 = np.clip(real - i0.astype(dtype), t(0), t(1)).astype(dtype)
    i1 = i0 + (i0 < in_size - 1)
    return LinearTaps(i0, i1, (t(1) - l1).astype(dtype), l1)
