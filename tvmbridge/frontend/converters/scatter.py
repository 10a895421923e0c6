"""Writes at computed indices (``x[idx] = v``, ``index_add``/``index_copy``/``index_fill``, which
export as ``index_put``; ``scatter``, ``scatter_add``, ``put``, ``masked_scatter``), checked like
PyTorch: an index out of range raises after the call and never writes outside the tensor.

Every integer ``index_put`` is one ``scatter_nd`` over the indexed axes moved to the front and
flattened (TVM's converter wants one index tensor per dimension and had no gradient);
``x[mask] = v`` is a ``where``. Their gradients are in ``passes/gradients.py``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import tvm
from tvm import relax

from .indexing import checked_index, checked_indices, indexed_layout, linear_index
from .registry import args_of, converter, kwargs_of

if TYPE_CHECKING:
    from ..importer import BridgeImporter


def _static(shape: Any) -> list[int] | None:
    """A torch or Relax shape as ints; None if any dimension is known only at run time."""
    dims = list(shape)
    return [int(d) for d in dims] if all(isinstance(d, (int, tvm.tirx.IntImm)) for d in dims) else None


def _put_mask(importer: BridgeImporter, node: torch.fx.Node, accumulate: bool) -> relax.Expr | None:
    """``x[mask] = v`` with one boolean mask over leading axes and a value that broadcasts over
    the rest (wav2vec2 writes a learned vector where time steps are masked): each masked place
    is written once, so ``accumulate`` adds ``v`` there."""
    x_arg, indices, value_arg = args_of(node)[:3]
    x_val = x_arg.meta["val"]
    mask = indices[0] if len(indices) == 1 else None
    m_val = mask.meta["val"] if isinstance(mask, torch.fx.Node) else None
    v_val = value_arg.meta["val"]
    if (
        m_val is None
        or m_val.dtype != torch.bool
        or m_val.dim() > x_val.dim()
        or tuple(map(str, m_val.shape)) != tuple(map(str, x_val.shape[: m_val.dim()]))
        or v_val.dim() > x_val.dim() - m_val.dim()
    ):
        return None
    x, value = importer.env[x_arg], importer.env[value_arg]
    rest = x_val.dim() - m_val.dim()
    cond = relax.op.reshape(importer.env[mask], [importer.prim(d) for d in m_val.shape] + [1] * rest)
    new = relax.op.add(x, value) if accumulate else value
    return importer.block_builder.emit(relax.op.where(cond, new, x))


def _put_integer(importer: BridgeImporter, node: torch.fx.Node, accumulate: bool) -> relax.Expr | None:
    """``x[i, :, j] = v`` for integer index tensors over any axes (None where an axis is whole):
    the value broadcast to ``x[indices]``'s shape in PyTorch's layout, moved to the flattened
    one and written by ``scatter_nd`` (``add`` when accumulating: repeats add up, as in ATen)."""
    x_arg, indices, value_arg = args_of(node)[:3]
    shape = _static(x_arg.meta["val"].shape)
    axes = [a for a, i in enumerate(indices) if i is not None]
    vals = [indices[a].meta.get("val") for a in axes]
    if shape is None or not axes or any(v is None or v.dtype in (torch.bool, torch.uint8) for v in vals):
        return None
    common = _static(torch.broadcast_shapes(*(tuple(v.shape) for v in vals)))
    if common is None:
        return None
    bb, op = importer.block_builder, relax.op
    others = [a for a in range(len(shape)) if a not in axes]
    sizes, rest = [shape[a] for a in axes], [shape[a] for a in others]
    index = [checked_index(importer, importer.env[indices[a]], shape[a], clip=True) for a in axes]
    linear = bb.emit(op.expand_dims(linear_index(bb, index, sizes, common), 1))
    order = axes + others
    x = importer.env[x_arg]
    moved = bb.emit(op.permute_dims(x, order)) if order != sorted(order) else x
    table = bb.emit(op.reshape(moved, [math.prod(sizes), *rest]))
    layout = indexed_layout(axes, others, len(common))
    front = common + rest
    target = [front[i] for i in layout] if layout is not None else front
    value = bb.emit(op.broadcast_to(op.astype(importer.env[value_arg], str(x.ty.dtype)), target))
    if layout is not None:
        value = bb.emit(op.permute_dims(value, [layout.index(i) for i in range(len(layout))]))
    value = bb.emit(op.reshape(value, [math.prod(common), *rest]))
    written = bb.emit(op.scatter_nd(table, linear, value, reduction="add" if accumulate else "update"))
    out = bb.emit(op.reshape(written, sizes + rest))
    return bb.emit(op.permute_dims(out, [order.index(i) for i in range(len(order))])) if order != sorted(order) else out


@converter("index_put.default", wraps_default=True)
def index_put(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``x[indices] = v`` (``accumulate``: ``+=``): a boolean mask, or integer index tensors."""
    args, kwargs = args_of(node), kwargs_of(node)
    accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
    written = _put_mask(importer, node, accumulate)
    written = written if written is not None else _put_integer(importer, node, accumulate)
    if written is not None:
        return written
    # the frontend's own write (an index of run-time length): its indices checked and clipped first
    with checked_indices(importer, importer.env[args[0]], list(args[1]), clip=True):
        return default(node)


def _scatter(importer: BridgeImporter, node: torch.fx.Node, src: relax.Expr, reduction: str) -> relax.Expr:
    """``x.scatter(dim, index, src)``: ``src`` read over ``index``'s extent (it may be larger),
    the index checked (no negative index, as in PyTorch)."""
    x_arg, dim, index_arg = args_of(node)[:3]
    bb, op = importer.block_builder, relax.op
    x, index = importer.env[x_arg], importer.env[index_arg]
    dims = _static(index_arg.meta["val"].shape)
    ndim = len(x_arg.meta["val"].shape)
    axis, size = int(dim) % ndim, int(x_arg.meta["val"].shape[int(dim)])
    idx = bb.emit(op.astype(index, "int64"))
    importer.range_flag(
        op.logical_and(op.greater_equal(idx, relax.const(0, "int64")), op.less(idx, relax.const(size, "int64")))
    )
    idx = bb.emit(op.clip(idx, relax.prim_value(0), relax.prim_value(size - 1)))
    if dims is not None and _static(src.ty.shape) != dims:
        src = bb.emit(op.strided_slice(src, axes=list(range(ndim)), begin=[0] * ndim, end=dims))
    return bb.emit(op.scatter_elements(x, idx, src, axis=axis, reduction=reduction))


@converter("scatter.src", "scatter_add.default")
def scatter_src(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    src = importer.env[args_of(node)[3]]
    return _scatter(importer, node, src, "add" if "scatter_add" in str(node.target) else "update")


@converter("scatter.value")
def scatter_value(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    x_arg, _, index_arg, value = args_of(node)[:4]
    shape = relax.ShapeExpr([importer.prim(d) for d in index_arg.meta["val"].shape])
    src = importer.block_builder.emit(relax.op.full(shape, relax.const(value, str(importer.env[x_arg].ty.dtype))))
    return _scatter(importer, node, src, "update")


@converter("put.default")
def put(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``x.put(index, source, accumulate)``: a write into ``x`` flattened."""
    args, kwargs = args_of(node), kwargs_of(node)
    x_arg, index_arg, source_arg = args[:3]
    accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
    bb, op = importer.block_builder, relax.op
    x = importer.env[x_arg]
    shape = _static(x_arg.meta["val"].shape)
    assert shape is not None, "put on a tensor of run-time size"
    size = math.prod(shape)
    index = checked_index(importer, bb.emit(op.reshape(importer.env[index_arg], [-1])), size, clip=True)
    source = bb.emit(op.reshape(bb.emit(op.astype(importer.env[source_arg], str(x.ty.dtype))), [-1]))
    flat = bb.emit(op.reshape(x, [size]))
    position = bb.emit(op.expand_dims(index, 1))
    written = bb.emit(op.scatter_nd(flat, position, source, reduction="add" if accumulate else "update"))
    return bb.emit(op.reshape(written, shape))


@converter("masked_scatter.default")
def masked_scatter(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``x.masked_scatter(mask, source)``: the masked places, in order, take ``source``'s
    leading elements; a source with fewer elements than masked places raises, as in PyTorch."""
    x_arg, mask_arg, source_arg = args_of(node)[:3]
    bb, op = importer.block_builder, relax.op
    x = importer.env[x_arg]
    shape = _static(node.meta["val"].shape)
    assert shape is not None, "masked_scatter on a tensor of run-time size"
    mask = bb.emit(op.reshape(bb.emit(op.broadcast_to(importer.env[mask_arg], shape)), [-1]))
    ordinal = bb.emit(op.cumsum(bb.emit(op.astype(mask, "int64")), axis=0))
    position = bb.emit(op.subtract(ordinal, relax.const(1, "int64")))
    count = math.prod(_static(source_arg.meta["val"].shape) or [0])
    source = bb.emit(op.reshape(importer.env[source_arg], [-1]))
    flat = bb.emit(op.reshape(x, [-1]))
    importer.range_flag(op.logical_or(op.logical_not(mask), op.less(position, relax.const(count, "int64"))))
    taken = bb.emit(op.take(source, position, axis=0, mode="clip"))
    return bb.emit(op.reshape(bb.emit(op.where(mask, taken, flat)), shape))
