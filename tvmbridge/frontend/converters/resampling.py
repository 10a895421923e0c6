"""Interpolation (``upsample_nearest2d``, ``upsample_bilinear2d``, antialiased bilinear and
bicubic) as ATen's CPU kernels compute it. (Plain bicubic reaches the bridge decomposed by
PyTorch into gathers.)

Relax's ``image.resize2d`` (what TVM's frontend makes of ``upsample_*``) rounds nearest
coordinates with ``half_pixel`` where PyTorch floors ``dst * scale``, and ignores the scale factor
the caller gave (PyTorch uses ``1/scale_factor``, not ``in/out``): a different picture. The bridge
converts interpolation itself, axis by axis, as gathers (``take``) at the indices below and, for
linear modes, a weighted sum of two gathers; the gradients are then ``take``'s, exact scatter-adds.
The arithmetic follows ``aten/src/ATen/native/UpSample.h`` in the dtype ATen uses (float for
nearest; the input's opmath type for linear).

Antialiased interpolation (``antialias=True``; timm resamples its position embeddings so, and
under ``torch.export`` even at the same size) reads a window per output index whose width grows
with the downscale (a 224 -> 7 resize reads 65 inputs per output), so each axis is a matmul by a
constant ``(out, in)`` matrix of ATen's normalized filter weights
(``_compute_indices_min_size_weights_aa`` in ``aten/src/ATen/native/cpu/UpSampleKernel.cpp``):
the last axis first, as ATen's separable kernel; an axis that keeps its size is not touched.
(ATen 2.13's resize of a one-column image along its height returns copies of the first row; the
matmuls give the column's resize, which the first-call check then reports as a disagreement.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import tvm
from tvm import relax

from ...errors import UnsupportedOpError
from .registry import args_of, converter, op_name

if TYPE_CHECKING:
    from ..importer import BridgeImporter


# --- where ATen reads from, per axis ------------------------------------------------------------
def source_scale(in_size: int, out_size: int, align_corners: bool, scale: float | None, dtype: str) -> np.floating:
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


# --- the converters -----------------------------------------------------------------------------
def _spatial_sizes(x: relax.Expr, node: torch.fx.Node, name: str) -> tuple[list, list]:
    """Input and output sizes, static in the resized (last two) axes, which the taps are computed
    for; the batch and channels may be symbolic (a variant serving every batch size)."""
    shape = getattr(x.ty, "shape", None)
    in_dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in shape] if shape is not None else []
    out_dims = [d if isinstance(d, int) else None for d in node.meta["val"].shape]
    if len(in_dims) != 4 or None in in_dims[2:] or None in out_dims[2:]:
        raise UnsupportedOpError("convert", "interpolation over a dynamic height or width", op=name)
    return in_dims, out_dims


@converter(
    "upsample_nearest2d.vec", "upsample_nearest2d.default", "upsample_bilinear2d.vec", "upsample_bilinear2d.default"
)
def upsample(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``upsample_nearest2d``/``upsample_bilinear2d`` as ATen computes them: a gather per axis,
    and for bilinear a weighted sum of two, the last axis first."""
    args = args_of(node)
    name = op_name(node)
    linear, vec = "bilinear" in name, name.endswith(".vec")
    x = importer.env[args[0]]
    in_dims, out_dims = _spatial_sizes(x, node, name)
    rest = list(args[2:])
    align = bool(rest.pop(0)) if linear else False
    if vec:
        scales = list(rest[0]) if rest and rest[0] is not None else [None, None]
    else:
        scales = (rest + [None, None])[:2]
    out = x
    for axis in (3, 2):
        out = _resample_axis(importer, out, axis, in_dims[axis], out_dims[axis], align, scales[axis - 2], linear)
    return out


def _resample_axis(
    importer: BridgeImporter,
    x: relax.Expr,
    axis: int,
    size: int,
    out: int,
    align: bool,
    scale: float | None,
    linear: bool,
) -> relax.Expr:
    bb, op = importer.block_builder, relax.op
    if not linear:
        idx = nearest_indices(size, out, scale)
        return bb.emit(op.take(x, relax.const(idx, "int64"), axis=axis, mode="clip"))
    dtype = str(x.ty.dtype)
    taps = linear_taps(size, out, align, scale, dtype)
    if taps is None:
        return x
    shape = [-1] + [1] * (len(x.ty.shape) - 1 - axis)
    parts = [
        op.multiply(op.take(x, relax.const(i, "int64"), axis=axis, mode="clip"), relax.const(w.reshape(shape), dtype))
        for i, w in ((taps.i0, taps.l0), (taps.i1, taps.l1))
    ]
    return bb.emit(op.add(*parts))


def _refusal(what: str) -> Callable:
    def refuse(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
        raise UnsupportedOpError(
            "convert", f"{what} is not supported; use fallback=True to keep PyTorch", op=op_name(node)
        )

    return refuse


converter("upsample_bicubic2d.vec")(_refusal("bicubic interpolation (no exact conversion yet)"))


# --- antialiased interpolation ------------------------------------------------------------------
def _triangle(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1, 1 - x, 0).astype(x.dtype)


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic with ``a = -0.5`` (``HelperInterpCubic::aa_filter``; plain bicubic uses -0.75)."""
    a, x = x.dtype.type(-0.5), np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0)).astype(x.dtype)


AA_FILTERS: dict[str, tuple[int, Callable[[np.ndarray], np.ndarray]]] = {
    "bilinear": (2, _triangle),
    "bicubic": (4, _keys_cubic),
}


def antialias_weights(
    in_size: int, out_size: int, mode: str, align_corners: bool, scale: float | None, dtype: str
) -> np.ndarray:
    """The ``(out_size, in_size)`` matrix of ATen's antialiased weights along one axis: per output
    index, the filter (widened by the downscale) over the inputs its window covers, normalized
    to sum to one."""
    interp, fn = AA_FILTERS[mode]
    t = np.dtype(dtype).type
    ratio = source_scale(in_size, out_size, align_corners, scale, dtype)
    support = t(interp * 0.5) * ratio if ratio >= 1 else t(interp * 0.5)
    invscale = t(1) / ratio if ratio >= 1 else t(1)
    max_taps = int(np.ceil(support)) * 2 + 1
    weights = np.zeros((out_size, in_size), dtype=dtype)
    for i in range(out_size):
        center = t(ratio * (i + 0.5))
        lo = max(int(center - support + t(0.5)), 0)
        size = min(max(min(int(center + support + t(0.5)), in_size) - lo, 0), max_taps)
        w = fn((np.arange(lo, lo + size).astype(dtype) - center + t(0.5)) * invscale)
        total = w.sum(dtype=dtype)
        weights[i, lo : lo + size] = w / total if total != 0 else w
    return weights


@converter(
    "_upsample_bilinear2d_aa.default",
    "_upsample_bilinear2d_aa.vec",
    "_upsample_bicubic2d_aa.default",
    "_upsample_bicubic2d_aa.vec",
)
def upsample_antialiased(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``interpolate(..., antialias=True)``: a matmul per resized axis (module docstring)."""
    args = args_of(node)
    name = op_name(node)
    x = importer.env[args[0]]
    in_dims, out_dims = _spatial_sizes(x, node, name)
    align = bool(args[2]) if len(args) > 2 else False
    if name.endswith(".vec"):
        scales = list(args[3]) if len(args) > 3 and args[3] is not None else [None, None]
    else:
        scales = (list(args[3:5]) + [None, None])[:2]
    mode = "bicubic" if "bicubic" in name else "bilinear"
    dtype = str(x.ty.dtype)
    opmath = "float64" if dtype == "float64" else "float32"  # half types: in float, rounded once per axis
    bb, out = importer.block_builder, x
    for axis in (3, 2):
        if in_dims[axis] == out_dims[axis]:
            continue
        w = antialias_weights(in_dims[axis], out_dims[axis], mode, align, scales[axis - 2], opmath)
        src = out if dtype == opmath else bb.emit(relax.op.astype(out, opmath))
        if axis == 3:  # (..., in) @ (in, out)
            out = bb.emit(relax.op.matmul(src, relax.const(np.ascontiguousarray(w.T), opmath)))
        else:  # (out, in) @ (..., in, width)
            out = bb.emit(relax.op.matmul(relax.const(w, opmath), src))
        out = out if dtype == opmath else bb.emit(relax.op.astype(out, dtype))
    return out
