"""Layout ops at the shapes the trace gave them: slices, ``slice_scatter``, ``repeat``, ``squeeze``,
``cat``, ``arange``, ``empty``, ``constant_pad_nd``, ``as_strided``, and ``detach`` (which stops
the gradient).

Symbolic sizes stay in shapes (``importer.prim``), where every pass and schedule downstream reads
them, rather than in the clamps and scalar arguments TVM's converters write, which Relax cannot
prove equal to the sizes they came from.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from tvm import relax
from tvm.relax.op.grad import no_grad

from ...errors import UnsupportedOpError
from .registry import args_of, converter, kwargs_of

if TYPE_CHECKING:
    from ..importer import BridgeImporter


@converter("detach.default")
def detach_stops_gradient(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``x.detach()`` (and what a ``no_grad`` region returns, see ``export``): the value, with
    no gradient through it. TVM's converter passes ``x`` on as it is, so a forward that
    detaches a tensor (a target built from the model's own output) got its gradient twice."""
    x = importer.env[args_of(node)[0]]
    return importer.block_builder.emit(no_grad(x)) if node.meta["val"].is_floating_point() else x


@converter("slice.Tensor", wraps_default=True)
def slice_traced(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``x[..., start:end:step]`` as the trace sized it: in bounds by construction (torch clamped
    it), so ``strided_slice`` need not clamp; clamping with symbolic sizes writes the length as
    ``min(s0, 512)``, which Relax cannot prove equal to ``s0``, and the sums downstream (position
    embeddings) lose their shapes."""
    args = list(args_of(node)) + [None] * (5 - len(args_of(node)))
    x_val, out_val = args_of(node)[0].meta["val"], node.meta["val"]
    dim = (args[1] or 0) % x_val.dim()
    start, step = args[2], args[4] or 1
    length = out_val.shape[dim]
    if start is None:
        start = 0
    if not isinstance(start, int):
        start = _start_to_the_end(x_val.shape[dim], length, args[3], step)
        if start is None:
            return default(node)  # a symbolic start elsewhere (the default converter's clamps are needed)
    if isinstance(length, int) and length == 0:
        return default(node)
    if isinstance(start, int) and start < 0:
        start = max(start + x_val.shape[dim], 0)
    end = start + step * (length - 1) + 1
    x = importer.env[args_of(node)[0]]
    if start == 0 and step == 1 and str(length) == str(x_val.shape[dim]):
        return x  # the whole axis (a mask cut to a length it already has)
    return importer.block_builder.emit(
        relax.op.strided_slice(x, [dim], [importer.prim(start)], [importer.prim(end)], [step], assume_inbound=True)
    )


def _start_to_the_end(size: int | torch.SymInt, length: int | torch.SymInt, end: object, step: int) -> object:
    """Where a slice with a symbolic start that runs to the axis' end begins (``x[:, -n:]``, the
    last ``n`` positions): ``size - length``, from the length torch derived; None for any other
    slice. The default converter clamps ``-n`` with ``if_then_else(0 < n, ...)``, an extent Relax
    cannot prove equal to ``n``, and every shape after it is unknown (XLM's positions)."""
    if step != 1 or not (end is None or (isinstance(end, int) and end >= sys.maxsize)):
        return None
    start = size - length
    expr = getattr(getattr(start, "node", None), "expr", None)
    return int(expr) if expr is not None and expr.is_number else start


@converter("slice_scatter.default", wraps_default=True)
def slice_scatter_traced(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``x[..., start:end] = src`` (step 1) as ``cat(x[..., :start], src, x[..., end:])``:
    Relax has no gradient for ``slice_scatter``, and the default writes a symbolic end
    (``shift_tokens_right``'s ``x[:, 1:] = ids[:, :-1]`` at any length) as a scalar argument;
    here every bound is static or the axis's end."""
    names_ = ("input", "src", "dim", "start", "end", "step")
    args = dict(zip(names_, args_of(node))) | dict(kwargs_of(node))
    x_val, src_val = args_of(node)[0].meta["val"], args["src"].meta["val"]
    dim = (args.get("dim") or 0) % x_val.dim()
    size, length = x_val.shape[dim], src_val.shape[dim]
    start = args.get("start") or 0
    if (args.get("step") or 1) != 1 or not isinstance(start, int) or (start < 0 and not isinstance(size, int)):
        return default(node)
    start = max(start + size, 0) if start < 0 else start
    end = start + length
    x, src = importer.env[args_of(node)[0]], importer.env[args["src"]]
    parts = [relax.op.strided_slice(x, [dim], [0], [start], assume_inbound=True)] if start > 0 else []
    parts.append(src)
    if str(end) != str(size):
        if not (isinstance(end, int) and isinstance(size, int)):
            return default(node)
        parts.append(relax.op.strided_slice(x, [dim], [end], [size], assume_inbound=True))
    return importer.block_builder.emit(relax.op.concat(parts, axis=dim)) if len(parts) > 1 else src


@converter("repeat.default", wraps_default=True)
def repeat_traced(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``x.repeat(r0, r1, ...)`` with a symbolic count (DeBERTa repeats its relative positions
    per batch and head) as ``x`` viewed as ``(1, s0, 1, s1, ...)``, broadcast to
    ``(r0, s0, r1, s1, ...)`` and merged pairwise: ``tile`` takes integer counts only."""
    args = args_of(node)
    reps = [r.meta["val"] if isinstance(r, torch.fx.Node) else r for r in args[1]]
    val = args[0].meta["val"]
    if all(isinstance(r, int) for r in reps):
        return default(node)
    sizes = [1] * (len(reps) - val.dim()) + list(val.shape)
    reps, sizes = [importer.prim(r) for r in reps], [importer.prim(d) for d in sizes]
    x = relax.op.reshape(importer.env[args[0]], [d for size in sizes for d in (1, size)])
    wide = relax.op.broadcast_to(x, [d for r, size in zip(reps, sizes) for d in (r, size)])
    return importer.block_builder.emit(relax.op.reshape(wide, [r * size for r, size in zip(reps, sizes)]))


@converter("squeeze.default", "squeeze.dim", "squeeze.dims")
def squeeze_traced(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``squeeze`` as a reshape to the shape the trace gave it: ATen drops only the listed axes
    of size 1, and with a symbolic axis listed (``squeeze(x, [0, 1])`` on a (batch, 1) gather
    in mBART's ``shift_tokens_right``) TVM's converter dropped the batch axis too: every row
    then read row 0's value."""
    return _reshape_to_traced(importer, node)


def _reshape_to_traced(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """The node's input reshaped to the shape the trace gave its output (symbolic sizes kept)."""
    shape = [importer.prim(d) for d in node.meta["val"].shape]
    return importer.block_builder.emit(relax.op.reshape(importer.env[args_of(node)[0]], shape))


@converter("view.default", "reshape.default", wraps_default=True)
def view_symbolic(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """A view or reshape to symbolic sizes (GPTBigCode's ``q.unsqueeze(1)...view(b, n, -1, 8)``
    in a variant over every batch and length) as a reshape to the shape the trace gave it: TVM's
    converter first tests whether the shape changes with ``==`` over the two lists, which for a
    size 1 against a symbolic length asks Python for the truth of a symbolic equation and fails;
    the call then compiled for its own shape instead."""
    sizes = args_of(node)[1]
    if all(isinstance(d, int) for d in sizes):
        return default(node)
    return _reshape_to_traced(importer, node)


def _arange_constant(args: list, val: torch.Tensor) -> relax.Expr | None:
    """``arange`` of numbers as ATen computes it, a constant. TVM's converter sized
    ``arange(16, -16, -1)`` 34 (its length rule assumes a positive step: Funnel's relative
    positions) and computes float steps in the result's dtype, where ATen accumulates in
    double (``arange(0, 1, 0.3)[3]`` one float32 ulp off)."""
    if not all(type(a) in (int, float) for a in args) or not all(isinstance(d, int) for d in val.shape):
        return None
    values = torch.arange(*args, dtype=val.dtype)
    if values.shape != val.shape:
        return None
    if val.dtype == torch.bfloat16:  # numpy has none: its values are exact in float32
        return relax.op.astype(relax.const(values.float().numpy(), "float32"), "bfloat16")
    return relax.const(values.numpy(), str(val.dtype).removeprefix("torch."))


@converter("arange.default", "arange.start", "arange.start_step", wraps_default=True)
def arange_traced(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``arange`` of numbers as a constant (:func:`_arange_constant`); of a symbolic length
    (``arange(seq)`` for positions and masks) as ``start + step * (cumsum(ones(n)) - 1)``: the
    length in a shape, which every pass and schedule downstream reads, not in scalar arguments."""
    val = node.meta["val"]
    args = list(args_of(node))
    constant = _arange_constant(args, val) if val.dim() == 1 else None
    if constant is not None:
        return importer.block_builder.emit(constant)
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
    if val.dim() != 1 or isinstance(val.shape[0], int) or not all(type(v) is int for v in (start, step)):
        return default(node)
    ones = relax.op.ones(relax.ShapeExpr([importer.prim(val.shape[0])]), "int64")
    index = relax.op.subtract(relax.op.cumsum(ones, axis=0), relax.const(1, "int64"))
    value = relax.op.add(relax.const(start, "int64"), relax.op.multiply(relax.const(step, "int64"), index))
    dtype = str(val.dtype).removeprefix("torch.")
    return importer.block_builder.emit(value if dtype == "int64" else relax.op.astype(value, dtype))


@converter("empty.memory_format", "empty_permuted.default")
def empty_traced_shape(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``empty(sizes)`` at its traced shape (sizes may be symbolic: ``x.new_empty(x.shape[0], 1)``;
    ``empty_permuted``, a dropout mask's buffer over a symbolic batch, orders only its strides)."""
    val = node.meta["val"]
    shape = [importer.prim(d) for d in val.shape]
    return importer.block_builder.emit(relax.op.zeros(shape, str(val.dtype).removeprefix("torch.")))


def empty_cat_part(val: torch.Tensor, dim: int) -> bool:
    """A ``cat`` part that adds nothing: 1-D empty, or of size 0 along the axis."""
    if val.dim() == 1 and isinstance(val.shape[0], int) and val.shape[0] == 0:
        return True
    size = val.shape[dim] if -val.dim() <= dim < val.dim() else None
    return isinstance(size, int) and size == 0


@converter("cat.default")
def cat_legacy_empty(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``cat`` skips empty parts: 1-D empty tensors whatever the others' rank (PyTorch's legacy
    rule, which transformers' key/value cache relies on: it starts from ``torch.tensor([])``),
    and parts of size 0 along the axis (a partial-rotary model's ``x[..., rot:]`` when the
    rotation covers the whole head). TVM has no empty tensors; these add nothing."""
    args, kwargs = args_of(node), kwargs_of(node)
    parts = [importer.env[n] for n in args[0]]
    vals = [n.meta["val"] for n in args[0]]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    kept = [p for p, v in zip(parts, vals) if not empty_cat_part(v, dim)] or parts[:1]
    if len(kept) == 1:
        return kept[0]
    return importer.block_builder.emit(relax.op.concat(kept, axis=dim))


@converter("constant_pad_nd.default")
def constant_pad(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``constant_pad_nd`` with negative widths too (they crop; Relax's ``pad`` wants >= 0)."""
    args, kwargs = args_of(node), kwargs_of(node)
    x = importer.env[args[0]]
    pads = list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0.0)
    shape = [importer.prim(d) for d in args[0].meta["val"].shape]  # symbolic sizes too
    ndim = len(shape)
    widths = [0] * (2 * ndim)
    for i in range(len(pads) // 2):  # pairs from the last dim backwards
        axis = ndim - 1 - i
        widths[2 * axis], widths[2 * axis + 1] = int(pads[2 * i]), int(pads[2 * i + 1])
    bb = importer.block_builder
    if any(w < 0 for w in widths):
        begin = [max(0, -widths[2 * a]) for a in range(ndim)]
        end = [shape[a] - max(0, -widths[2 * a + 1]) for a in range(ndim)]
        x = bb.emit(relax.op.strided_slice(x, list(range(ndim)), begin, end))
        widths = [max(0, w) for w in widths]
    if not any(widths):
        return bb.emit(relax.op.astype(x, str(x.ty.dtype)))
    return bb.emit(relax.op.nn.pad(x, widths, "constant", 0.0 if value is None else value))


@converter("as_strided.default")
def as_strided_read(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``as_strided`` (Longformer/LED's overlapping attention chunks, taken from a transposed view)
    as one ``take`` of the input's elements at the positions the strides name in its storage,
    computed at compile time (its gradient the take's scatter-add, which sums overlapping windows
    as PyTorch does). Only where that storage holds the input's own elements, each once (a dense
    layout in any axis order), and every position is inside it; else refused."""
    args, kwargs = args_of(node), kwargs_of(node)
    given = {**dict(zip(("self", "size", "stride", "storage_offset"), args)), **kwargs}
    source, size, stride = given["self"].meta.get("val"), given["size"], given["stride"]
    numbers = [*size, *stride, given.get("storage_offset") or 0]
    numbers += [*source.shape, *source.stride()] if source is not None else [None]
    if source is None or not all(type(n) is int for n in numbers):
        raise UnsupportedOpError("convert", "as_strided at symbolic sizes", op="as_strided")
    element_at = _storage_to_element(list(source.shape), list(source.stride()))
    offset = given.get("storage_offset")
    start = 0 if offset is None else offset - source.storage_offset()
    positions = _strided_positions(start, list(size), list(stride))
    if element_at is None or (positions.size and (positions.min() < 0 or positions.max() >= source.numel())):
        raise UnsupportedOpError(
            "convert", "as_strided over a tensor whose storage holds more than its own elements", op="as_strided"
        )
    bb = importer.block_builder
    flat = bb.emit(relax.op.reshape(importer.env[given["self"]], [source.numel()]))
    return bb.emit(relax.op.take(flat, relax.const(element_at[positions], "int64"), axis=0))


def _strided_positions(start: int, size: list[int], stride: list[int]) -> np.ndarray:
    """``start + sum(i_k * stride_k)`` over every index of ``size``."""
    positions = np.full(size, start, dtype="int64")
    for axis, (n, step) in enumerate(zip(size, stride)):
        positions += (np.arange(n, dtype="int64") * step).reshape([-1 if a == axis else 1 for a in range(len(size))])
    return positions


def _storage_to_element(shape: list[int], stride: list[int]) -> np.ndarray | None:
    """For each storage position a tensor of ``shape``/``stride`` spans, its element's row-major
    index; None where the layout is not dense (a gap, or an element stored twice)."""
    numel = int(np.prod(shape, dtype="int64"))
    stored = _strided_positions(0, shape, stride).reshape(-1)
    if numel == 0 or not np.array_equal(np.sort(stored), np.arange(numel)):
        return None
    element_at = np.empty(numel, dtype="int64")
    element_at[stored] = np.arange(numel, dtype="int64")
    return element_at
