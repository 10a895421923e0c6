"""Mixture-of-experts routing at static shapes: ``histc`` (tokens per expert) and grouped
matrix products (``transformers::grouped_mm_fallback``, ``aten::_grouped_mm``), whose groups are
sized by the data. Each row is multiplied by every expert's weight and the product of its own
group kept, so shapes stay static and the gradient follows from Relax's (the products cost
``experts`` times the routed ones: the price of a static graph)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tvm import relax

from ...errors import UnsupportedOpError
from .registry import args_of, converter, kwargs_of, op_name

if TYPE_CHECKING:
    from ..importer import BridgeImporter


@converter("histc.default")
def histc(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """ATen's CPU ``histc`` (no local search): bin ``trunc((x - min) * bins / (max - min))``, the
    last bin closed, values outside ``[min, max]`` and NaN skipped. An empty range (``min ==
    max``, the default) is refused: ATen then takes the data's own range."""
    given = dict(zip(("input", "bins", "min", "max"), args_of(node)), **kwargs_of(node))
    bins, low, high = int(given.get("bins", 100)), float(given.get("min", 0)), float(given.get("max", 0))
    if low == high:
        raise UnsupportedOpError(
            "convert", "torch.histc without min < max (the bins would be set by the data's range)", op="histc"
        )
    bb, op = importer.block_builder, relax.op
    x = bb.emit(op.reshape(importer.env[given["input"]], [-1]))
    dtype = str(x.ty.dtype)
    lo, hi = relax.const(low, dtype), relax.const(high, dtype)
    scaled = op.divide(op.multiply(op.subtract(x, lo), relax.const(float(bins), dtype)), op.subtract(hi, lo))
    position = bb.emit(op.minimum(op.astype(scaled, "int64"), relax.const(bins - 1, "int64")))
    inside = bb.emit(op.logical_and(op.greater_equal(x, lo), op.less_equal(x, hi)))
    member = op.equal(op.expand_dims(position, 1), op.expand_dims(op.arange(0, bins, 1, "int64"), 0))
    counted = op.logical_and(member, op.expand_dims(inside, 1))
    return bb.emit(op.sum(op.astype(counted, dtype), axis=0))


def grouped_rows(bb: relax.BlockBuilder, rows: relax.Expr, weight: relax.Expr, offsets: relax.Expr) -> relax.Expr:
    """``rows[s] @ weight[e]`` for the group ``e`` holding row ``s`` (``offsets[e-1] <= s <
    offsets[e]``), zero past the last offset, as the grouped product leaves those rows."""
    op = relax.op
    count, experts = rows.ty.shape[0], weight.ty.shape[0]
    index = str(offsets.ty.dtype)
    row_ids = op.expand_dims(op.arange(0, count, 1, index), 1)
    group = bb.emit(op.sum(op.astype(op.less_equal(op.expand_dims(offsets, 0), row_ids), index), axis=1))
    member = bb.emit(op.equal(op.expand_dims(op.arange(0, experts, 1, index), 1), op.expand_dims(group, 0)))
    products = bb.emit(op.matmul(op.expand_dims(rows, 0), weight))  # (experts, rows, out)
    zero = relax.const(0, str(products.ty.dtype))
    return bb.emit(op.sum(op.where(op.expand_dims(member, 2), products, zero), axis=0))


@converter("grouped_mm_fallback.default")
def grouped_mm_fallback(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """transformers' grouped product, ``(rows, in) x (experts, in, out)`` by offsets."""
    given = dict(zip(("input", "weight", "offs"), args_of(node)), **kwargs_of(node))
    env = importer.env
    return grouped_rows(importer.block_builder, env[given["input"]], env[given["weight"]], env[given["offs"]])


@converter("_grouped_mm.default")
def grouped_mm(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``torch._grouped_mm(rows, weights, offs=...)`` with 2-d rows and 3-d weights; the other
    layouts (grouped weight gradients, bias, another output dtype) are refused by name."""
    given = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args_of(node)), **kwargs_of(node))
    rows, weight = importer.env[given["self"]], importer.env[given["mat2"]]
    same_dtype = given.get("out_dtype") in (None, node.meta["val"].dtype)
    if given.get("offs") is None or given.get("bias") is not None or not same_dtype or len(rows.ty.shape) != 2:
        raise UnsupportedOpError(
            "convert", f"{op_name(node)} other than 2-d rows by 3-d weights at offsets", op="_grouped_mm"
        )
    return grouped_rows(importer.block_builder, rows, weight, importer.env[given["offs"]])
