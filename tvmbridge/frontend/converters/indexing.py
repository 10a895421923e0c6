"""Reads at computed indices, checked like PyTorch: an index out of range raises, never reads out of
bounds.

Embeddings and ``gather`` read clipped indices and return a flag that they were all in range
(``importer.index_checks``: the runtime raises where one is 0); ``take`` and ``x[idx]`` fold theirs
into one flag (``importer.range_flag``). ``padding_idx`` gets no gradient, as in PyTorch; negative
indices read from the end where PyTorch reads them so; a
multi-output op's other outputs are refused where the frontend would hand back the first.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax.op.grad import no_grad
from tvm.sym.analyzer import Analyzer

from ...errors import UnsupportedOpError
from .registry import args_of, converter, kwargs_of

if TYPE_CHECKING:
    from ..importer import BridgeImporter


@converter("embedding.default")
def embedding(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """Clipped reads, a range flag, no gradient at ``padding_idx``."""
    args, kwargs = args_of(node), kwargs_of(node)
    weight, indices = importer.env[args[0]], importer.env[args[1]]
    padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    scale = args[3] if len(args) > 3 else kwargs.get("scale_grad_by_freq", False)
    sparse = args[4] if len(args) > 4 else kwargs.get("sparse", False)
    if scale or sparse:
        what = "sparse=True (a sparse gradient)" if sparse else "scale_grad_by_freq=True"
        raise UnsupportedOpError(
            "convert",
            f"an embedding with {what}, which the compiled backward does not give: dispatch the modules "
            "around the embedding instead, use a dense embedding (sparse=False, scale_grad_by_freq=False), "
            "or pass fallback=True to keep PyTorch for this module",
            op="embedding",
        )
    bb = importer.block_builder
    rows = int(weight.ty.shape[0])
    idx = bb.emit(relax.op.astype(indices, "int64"))
    low = relax.op.greater_equal(idx, relax.const(0, "int64"))
    high = relax.op.less(idx, relax.const(rows, "int64"))
    importer.index_checks.append(bb.emit(relax.op.min(relax.op.astype(relax.op.logical_and(low, high), "int32"))))
    flat = bb.emit(relax.op.reshape(idx, [-1]))
    out = bb.emit(relax.op.take(weight, flat, axis=0, mode="clip"))
    if padding_idx is not None and padding_idx >= 0:
        # forward: the row as it is; gradient: none from positions at padding_idx
        dtype = str(weight.ty.dtype)
        keep = bb.emit(relax.op.astype(relax.op.not_equal(flat, relax.const(padding_idx, "int64")), dtype))
        keep = bb.emit(relax.op.expand_dims(keep, axis=1))
        drop = bb.emit(relax.op.subtract(relax.const(1.0, dtype), keep))
        out = bb.emit(relax.op.add(relax.op.multiply(out, keep), relax.op.multiply(no_grad(out), drop)))
    return bb.emit(relax.op.reshape(out, list(indices.ty.shape) + [weight.ty.shape[1]]))


@converter("gather.default")
def gather_checked(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``gather`` (and so ``cross_entropy``'s pick of the target class) with the embedding's
    guard: clipped indices and a flag, so a class index out of range raises like PyTorch
    instead of reading out of bounds. Negative indices are out of range for ``gather``."""
    args, kwargs = args_of(node), kwargs_of(node)
    x, index = importer.env[args[0]], importer.env[args[2]]
    axis = int(args[1]) % max(len(x.ty.shape), 1)
    if kwargs.get("sparse_grad", False) or (len(args) > 3 and args[3]):
        raise UnsupportedOpError("convert", "gather with sparse_grad=True", op="gather")
    bb = importer.block_builder
    idx = bb.emit(relax.op.astype(index, "int64"))
    size = x.ty.shape[axis] if x.ty.shape else 1
    clipped = bb.emit(relax.op.clip(idx, relax.prim_value(0), relax.prim_value(size - 1)))
    importer.index_checks.append(bb.emit(relax.op.min(relax.op.astype(relax.op.equal(idx, clipped), "int32"))))
    return bb.emit(relax.op.gather_elements(x, clipped, axis=axis))


@converter("take.default")
def take_flat(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``torch.take``: indices into the flattened input, negative ones from the end; the
    frontend reads a negative one out of bounds. Clipped reads with the embedding's range
    flag, so an index out of range raises like PyTorch."""
    args = args_of(node)
    bb, op = importer.block_builder, relax.op
    x, index = importer.env[args[0]], importer.env[args[1]]
    flat = bb.emit(op.reshape(x, [-1]))
    n = relax.const(int(math.prod(int(d) for d in x.ty.shape)), "int64")
    idx = bb.emit(op.astype(index, "int64"))
    importer.range_flag(op.logical_and(op.greater_equal(idx, op.negative(n)), op.less(idx, n)))
    wrapped = bb.emit(op.where(op.less(idx, relax.const(0, "int64")), op.add(idx, n), idx))
    return bb.emit(op.take(flat, wrapped, axis=0, mode="clip"))


@converter("index_select.default")
def index_select_checked(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``x.index_select(dim, idx)``: a ``take`` whose indices must lie in ``[0, size)`` (ATen
    refuses negative ones too), folded into the range flag; the frontend's ``take`` read an index
    out of range clipped, without an error. Over a 0-d ``x`` (a size of 1) the value itself,
    shaped as the result (Relax's axis checks refuse the ``take``)."""
    args = args_of(node)
    x, index = importer.env[args[0]], importer.env[args[2]]
    shape = list(x.ty.shape)
    bb, op = importer.block_builder, relax.op
    idx = bb.emit(op.astype(index, "int64"))
    n = size_tensor(bb, _size(shape[int(args[1]) % len(shape)]) if shape else 1)
    importer.range_flag(op.logical_and(op.greater_equal(idx, relax.const(0, "int64")), op.less(idx, n)))
    if not shape:
        return bb.emit(op.reshape(x, [int(d) for d in node.meta["val"].shape]))
    return bb.emit(op.take(x, idx, axis=int(args[1]) % len(shape), mode="clip"))


@converter("index.Tensor", wraps_default=True)
def index_from_end(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``x[idx]`` (``index.Tensor``, and so ``torch.take``): the frontend reads a negative
    index out of bounds (``take`` in its unchecked mode). Each integer index tensor is read
    from the end where negative and checked against the axis (the embedding's range flag:
    out of range raises like PyTorch), then the frontend's conversion runs on those."""
    args = args_of(node)
    x = importer.env[args[0]]
    with checked_indices(importer, x, list(args[1])):
        joint = _joint_index(importer, node, x, list(args[1]))
        return joint if joint is not None else default(node)


@contextlib.contextmanager
def checked_indices(importer: BridgeImporter, x: relax.Expr, indices: list, clip: bool = False) -> Iterator[None]:
    """For the block, each integer index tensor of ``x[indices]`` (one per axis, None where an
    axis is whole) read through :func:`checked_index` against its axis' size, static or symbolic
    (``clip`` for writes): what a conversion reads then never lies outside ``x``. The frontend's
    own conversions read (and write) indices unchecked, negative ones out of bounds."""
    saved: dict[torch.fx.Node, relax.Expr] = {}
    shape = x.ty.shape
    for axis, idx_node in enumerate(indices):
        val = getattr(idx_node, "meta", {}).get("val")
        size = shape[axis] if shape is not None and axis < len(shape) else None
        if val is None or val.dtype in (torch.bool, torch.uint8) or size is None or idx_node in saved:
            continue
        saved[idx_node] = importer.env[idx_node]
        importer.env[idx_node] = checked_index(importer, importer.env[idx_node], _size(size), clip)
    try:
        yield
    finally:
        importer.env.update(saved)


def checked_index(
    importer: BridgeImporter, index: relax.Expr, size: int | tvm.tirx.PrimExpr, clip: bool = False
) -> relax.Expr:
    """``index`` as int64 read from the end where negative, its range (``-size <= i < size``)
    folded into the importer's range flag (out of range raises after the call, as PyTorch
    raises). ``clip``: kept inside the axis too, for writes, which must never land outside it.
    ``size`` may be symbolic (an axis of a variant serving every batch size)."""
    bb, op = importer.block_builder, relax.op
    size = _size(size) if isinstance(size, tvm.tirx.IntImm) else size
    n = size_tensor(bb, size)
    idx = bb.emit(op.astype(index, "int64"))
    importer.range_flag(op.logical_and(op.greater_equal(idx, op.negative(n)), op.less(idx, n)))
    wrapped = op.where(op.less(idx, relax.const(0, "int64")), op.add(idx, n), idx)
    return bb.emit(op.clip(wrapped, relax.prim_value(0), relax.prim_value(size - 1)) if clip else wrapped)


def _size(d: tvm.tirx.PrimExpr) -> int | tvm.tirx.PrimExpr:
    """An axis size as an int where static, else the symbolic expression."""
    return int(d) if isinstance(d, tvm.tirx.IntImm) else d


def size_tensor(bb: relax.BlockBuilder, size: int | tvm.tirx.PrimExpr) -> relax.Expr:
    """A size as a 0-d int64 tensor: a constant where static, read from the shape where symbolic."""
    if isinstance(size, int):
        return relax.const(size, "int64")
    return bb.emit(relax.op.reshape(relax.op.shape_to_tensor(relax.ShapeExpr([size])), []))


def linear_index(bb: relax.BlockBuilder, indices: list[relax.Expr], sizes: list, common: list) -> relax.Expr:
    """Index tensors over axes of ``sizes`` (ints, or symbolic sizes), broadcast to ``common``, as
    one flat int64 index into those axes flattened (row-major)."""
    op, linear = relax.op, None
    for k, index in enumerate(indices):
        stride = _product(sizes[k + 1 :])
        term = op.broadcast_to(op.astype(index, "int64"), common)
        term = term if isinstance(stride, int) and stride == 1 else op.multiply(term, size_tensor(bb, stride))
        linear = term if linear is None else op.add(linear, term)
    assert linear is not None
    return bb.emit(op.reshape(bb.emit(linear), [-1]))


def _product(sizes: list) -> int | tvm.tirx.PrimExpr:
    """The product of sizes: an int where all are static, else a simplified expression."""
    if all(isinstance(d, int) for d in sizes):
        return math.prod(sizes)
    total = math.prod(sizes[1:], start=sizes[0])
    simplified = Analyzer().simplify(total)
    return int(simplified) if isinstance(simplified, tvm.tirx.IntImm) else simplified


def _broadcast(shapes: list[list]) -> list | None:
    """The broadcast of index shapes given as Relax sizes, or None where it is not provable at
    compile time (two symbolic sizes that may differ)."""
    analyzer, rank = Analyzer(), max(len(s) for s in shapes)
    out = []
    for dim in range(rank):
        sizes = [s[len(s) - rank + dim] for s in shapes if len(s) - rank + dim >= 0]
        wide = [d for d in sizes if not (isinstance(d, tvm.tirx.IntImm) and int(d) == 1)]
        if wide and not all(analyzer.can_prove_equal(d, wide[0]) for d in wide):
            return None
        out.append(_size(wide[0]) if wide else 1)
    return out


def indexed_layout(axes: list[int], others: list[int], common: int) -> list[int] | None:
    """Where PyTorch puts ``x[indices]``'s dims, from the layout ``common dims + other axes``:
    the permutation to apply, or None where that layout is PyTorch's (indexed axes apart, or
    adjacent from the first axis). Adjacent indexed axes put the common dims where they were."""
    before = [a for a in others if a < axes[0]]
    if axes != list(range(axes[0], axes[-1] + 1)) or not before:
        return None
    nbefore = len(before)
    return (
        list(range(common, common + nbefore))
        + list(range(common))
        + list(range(common + nbefore, common + len(others)))
    )


def _joint_index(
    importer: BridgeImporter, node: torch.fx.Node, x: relax.Expr, indices: list[torch.fx.Node | None]
) -> relax.Expr | None:
    """Two or more integer index tensors (``x[rows, cols]``, a sequence classifier's
    ``logits[arange(b), last]``, ``x[:, :, i, j]``): PyTorch broadcasts them together and reads
    one element per broadcast position, the result's indexed dims where the first indexed axis
    was if the indexed axes are adjacent, else in front. The frontend's conversion took the
    outer product of some (a transposed or wrong-shaped result) and had no gradient for the
    rest. Here: the indexed axes moved to the front and flattened, one ``take`` at the linear
    index (the embedding's gradient), the dims put where PyTorch puts them. None where another
    conversion applies (one index, a mask, index shapes whose broadcast only the run decides).
    Sizes may be symbolic (a sequence classifier's rows over any batch and length)."""
    axes = [a for a, i in enumerate(indices) if i is not None]
    metas = [getattr(indices[a], "meta", {}).get("val") for a in axes]
    shape = list(x.ty.shape) if x.ty.shape is not None else []
    vals = [v for v in metas if isinstance(v, torch.Tensor) and v.dtype not in (torch.bool, torch.uint8)]
    if len(axes) < 2 or len(vals) != len(axes):
        return None
    index_shapes = [getattr(importer.env[indices[a]].ty, "shape", None) for a in axes]
    if any(s is None or a >= len(shape) for s, a in zip(index_shapes, axes)):
        return None
    common = _broadcast([list(s) for s in index_shapes if s is not None])
    if common is None:
        return None
    bb, op = importer.block_builder, relax.op
    sizes = [_size(shape[a]) for a in axes]
    linear = linear_index(bb, [importer.env[indices[a]] for a in axes], sizes, common)
    others = [a for a in range(len(shape)) if a not in axes]
    moved = bb.emit(op.permute_dims(x, axes + others)) if axes + others != list(range(len(shape))) else x
    table = bb.emit(op.reshape(moved, [_product(sizes)] + [shape[a] for a in others]))
    taken = bb.emit(op.take(table, linear, axis=0, mode="clip"))
    out = bb.emit(op.reshape(taken, common + [shape[a] for a in others]))
    order = indexed_layout(axes, others, len(common))
    if order is not None:
        out = bb.emit(op.permute_dims(out, order))
    val = node.meta.get("val")
    expected = [int(d) for d in val.shape] if val is not None and all(isinstance(d, int) for d in val.shape) else None
    got = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in out.ty.shape]
    if expected is not None and None not in got and got != expected:
        raise UnsupportedOpError(
            "convert", f"x[indices] came out {got}, PyTorch's is {expected}: please report this", op="index.Tensor"
        )
    return out


@converter("diagonal.default", wraps_default=True)
def diagonal(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``x.diagonal(offset, dim1, dim2)`` (``torch.trace``, ``torch.einsum("ii->i")``, a
    contrastive loss's ``logits.diag()``) as one ``take`` from the two axes flattened, whose
    gradient is the embedding's: the frontend reads it with a repeated-letter ``einsum``, which
    has no gradient. A run-time size keeps the frontend's form."""
    args = args_of(node)
    given = {**dict(zip(("self", "offset", "dim1", "dim2"), args)), **kwargs_of(node)}
    x = importer.env[given["self"]]
    shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in x.ty.shape]
    ndim = len(shape)
    offset = int(given.get("offset", 0))
    dim1, dim2 = int(given.get("dim1", 0)) % ndim, int(given.get("dim2", 1)) % ndim
    n1, n2 = shape[dim1], shape[dim2]
    if n1 is None or n2 is None:
        return default(node)
    row, col = max(-offset, 0), max(offset, 0)
    length = max(0, min(n1 - row, n2 - col))
    others = [a for a in range(ndim) if a not in (dim1, dim2)]
    bb, op = importer.block_builder, relax.op
    moved = bb.emit(op.permute_dims(x, others + [dim1, dim2]))
    flat = bb.emit(op.reshape(moved, [*(x.ty.shape[a] for a in others), n1 * n2]))
    index = relax.const(np.array([(i + row) * n2 + i + col for i in range(length)], dtype="int64"), "int64")
    return bb.emit(op.take(flat, index, axis=len(others), mode="clip"))


@converter("select.int")
def select_wrapped(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``x.select(dim, i)`` (``x[:, -1]``): the frontend reads a negative ``i`` out of bounds
    (``take`` in its unchecked mode); read it as Python does, from the end."""
    args = args_of(node)
    x, dim, index = importer.env[args[0]], int(args[1]), int(args[2])
    mode = "wrap" if index < 0 else "clip"  # in range: export checked it; "clip" needs no warning
    return importer.block_builder.emit(relax.op.take(x, relax.const(index, "int64"), axis=dim, mode=mode))


@converter("getitem", wraps_default=True)
def getitem_checked(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``out[i]`` of a multi-output op whose converter made one tensor (``native_layer_norm``'s
    mean and rstd): the frontend's ``getitem`` returns that tensor for every ``i``, a silently
    wrong value for ``i > 0``; refused instead."""
    args = args_of(node)
    source, index = args[0], args[1]
    value = importer.env.get(source) if isinstance(source, torch.fx.Node) else None
    multi = isinstance(getattr(source, "meta", {}).get("val"), (list, tuple))
    if (
        multi
        and isinstance(value, relax.Expr)
        and isinstance(value.ty, relax.TensorType)
        and isinstance(index, int)
        and index != 0
    ):
        raise UnsupportedOpError(
            "convert",
            f"output {index} of {source.target.__name__} (the converter gives only its first "
            "output); use fallback=True",
            op=getattr(source.target, "__name__", str(source.target)),
        )
    return default(node)
