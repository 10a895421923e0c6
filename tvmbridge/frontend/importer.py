"""Convert an exported program to a Relax ``IRModule`` with the bridge's converters.

The Relax frontend is built for inference. The bridge changes what it would get silently wrong
for training, and makes every other failure name its aten op:

* random ops (dropout in every form, ``bernoulli``, ``rand*``, ``randn*``, ...) become
  :class:`RandomSite` markers that ``passes.random`` turns into per-call inputs, drawn from
  PyTorch's generator at every call (``runtime/random.py``): never values frozen at compile time.
  A random op whose draw depends on computed values is refused;
* BatchNorm is written out in arithmetic the gradient pass knows, in train mode with the batch
  statistics (and the new running statistics) computed in double as ATen's CPU kernel does, in
  eval mode with the running statistics;
* embeddings read clipped indices and return a flag that they were all in range, so an index
  out of range raises like PyTorch instead of reading out of bounds; ``padding_idx`` gets no
  gradient, as in PyTorch;
* matmul-like ops keep the input dtype (the frontend fixes ``out_dtype="float32"``);
* arguments the frontend would ignore (``avg_pool2d``'s ``divisor_override`` with ``ceil_mode``,
  ``max_pool2d``'s indices) are refused instead of converted wrong.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import tvm
from torch.export import ExportedProgram
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter
from tvm.relax.op.grad import no_grad

from .. import names
from ..errors import ConversionError, UnsupportedOpError, stage_errors
from ..ir import only_dataflow_block, rebuild, static_shape
from ..sizes import sympy_to_tir
from .batch_norm import BatchNormConverters
from .export import COPY_OPS, TracedModule
from .provenance import origins
from .sites import RandomSite, SizeList, TensorMeta
from . import resample

aten = torch.ops.aten
_DROPOUT_OPS = {"dropout.default", "native_dropout.default"}
# random ops whose tensor arguments give only a shape, dtype and layout: replayable per call
_SHAPE_ONLY_RANDOM = {
    "bernoulli.p", "rand_like.default", "randn_like.default", "randint_like.default", "randint_like.low_dtype",
    "uniform.default", "exponential.default", "geometric.default", "log_normal.default", "cauchy.default",
    "random.default", "random.from", "random.to", "normal_functional.default",
}


@dataclass(frozen=True)
class Converted:
    """The Relax module and what the runtime needs to call it: the random inputs to draw and how
    many index-range flags follow the other outputs."""

    mod: tvm.IRModule
    random_sites: tuple[RandomSite, ...]
    num_index_checks: int
    probes: tuple[str, ...] = ()  # fx node names of the probed values (to_relax(probe=True))


def is_train_dropout(node: torch.fx.Node) -> bool:
    """A dropout that drops something: train mode and ``p > 0``."""
    if getattr(node.target, "__name__", "") not in _DROPOUT_OPS:
        return False
    p = float(node.args[1])
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return bool(train) and p > 0.0


def _dims(values: Any) -> tuple[int | str, ...]:
    """Sizes or strides as traced: ints, and the expression of a symbolic one as text (``s0``),
    which the runtime evaluates with the call's sizes."""
    return tuple(int(v) if isinstance(v, int) else str(v.node.expr) for v in values)


def _size_value(v: Any) -> int | str | None:
    """A size as traced (an int, or a symbolic one's expression), or None when ``v`` is none."""
    if isinstance(v, torch.fx.Node):
        v = v.meta.get("val")
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return int(v)
    return str(v.node.expr) if isinstance(v, torch.SymInt) else None


def _meta(value: Any) -> Any:
    """A random op's argument as the runtime replays it: a tensor's layout, a size list (fx's own
    list type, and symbolic sizes, would not reach the op), or the value itself."""
    if isinstance(value, (list, tuple)) and value and all(_size_value(v) is not None for v in value):
        return SizeList(tuple(_size_value(v) for v in value))
    if isinstance(value, torch.fx.Node):
        v = value.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise ConversionError("convert", f"random op argument {value} is not a tensor")
        return TensorMeta(_dims(v.shape), _dims(v.stride()), v.dtype)
    if isinstance(value, torch.SymInt):
        raise UnsupportedOpError("convert", "a random op with a symbolic scalar argument", op="random")
    return list(value) if isinstance(value, list) else value


def _uses_of_item(node: torch.fx.Node, index: int) -> list[torch.fx.Node]:
    return [u for u in node.users if u.target is operator.getitem and u.args[1] == index and u.users]


class BridgeImporter(BatchNormConverters, ExportedProgramImporter):
    """The Relax frontend with the bridge's converters and errors that name the aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.random_sites: list[RandomSite] = []
        self.index_checks: list[relax.Expr] = []
        self.symbols: dict[str, tvm.tirx.Var] = {}  # torch's shape symbols as the frontend named them

    def create_input_vars(self, exported_program: ExportedProgram) -> tuple:
        made = super().create_input_vars(exported_program)
        for var in [*made[0].values(), *made[1].values()]:
            for dim in var.ty.shape:
                if isinstance(dim, tvm.tirx.Var):
                    self.symbols[dim.name] = dim
        return made

    def _process_derived_symbol(self, expr: Any, table: dict) -> tuple:
        """An input size that is a SymInt specialised to a number (dynamo's graph hands on a size
        it has since fixed) is that number: TVM's frontend made it a variable named ``66``,
        which no call binds."""
        if getattr(expr, "is_number", False):
            return str(expr), tvm.tirx.IntImm("int64", int(expr))
        return super()._process_derived_symbol(expr, table)

    def prim(self, dim: int | torch.SymInt) -> int | tvm.tirx.PrimExpr:
        """A traced dimension as Relax writes it: an int, or the TIR expression of its symbol."""
        if isinstance(dim, int):
            return dim
        return sympy_to_tir(dim.node.expr, self.symbols)

    def create_convert_map(self) -> dict[str, Callable]:
        table = super().create_convert_map()
        table.update({
            "dropout.default": self._dropout_value,
            "native_dropout.default": self._dropout_tuple,
            "matmul.default": self._matmul,
            "mm.default": self._matmul,
            "bmm.default": self._matmul,
            "addmm.default": self._addmm_keep_dtype,
            "linear.default": self._linear_keep_dtype,
            "_native_batch_norm_legit_functional.default": self._batch_norm_train,
            "_native_batch_norm_legit.no_stats": self._batch_norm_no_stats,
            "_native_batch_norm_legit_no_training.default": self._batch_norm_eval,
            "batch_norm.default": self._batch_norm_aten,
            "embedding.default": self._embedding,
            "slice.Tensor": self._slice_traced(table["slice.Tensor"]),
            "slice_scatter.default": self._slice_scatter_traced(table["slice_scatter.default"]),
            "repeat.default": self._repeat_traced(table["repeat.default"]),
            **{name: self._squeeze_traced for name in ("squeeze.default", "squeeze.dim", "squeeze.dims")},
            "index_put.default": self._index_put_mask(table["index_put.default"]),
            **{name: self._arange_traced(table[name]) for name in ("arange.default", "arange.start", "arange.start_step")},
            "detach.default": self._detach_stops_gradient,
            "gather.default": self._gather_checked,
            "select.int": self._select_wrapped,
            "cat.default": self._cat_legacy_empty,
            "empty.default": self._empty_traced_shape,
            "empty.memory_format": self._empty_traced_shape,
            "avg_pool2d.default": self._avg_pool2d_checked,
            "max_pool2d_with_indices.default": self._max_pool_values_only(table["max_pool2d_with_indices.default"]),
            "max_pool3d_with_indices.default": self._max_pool_values_only(table["max_pool3d_with_indices.default"]),
        })
        table.update(self._nn_converters(table))
        return {name: self._named(name, fn) for name, fn in table.items()}

    def _detach_stops_gradient(self, node: torch.fx.Node) -> relax.Expr:
        """``x.detach()`` (and what a ``no_grad`` region returns, see ``export``): the value, with
        no gradient through it. TVM's converter passes ``x`` on as it is, so a forward that
        detaches a tensor (a target built from the model's own output) got its gradient twice."""
        x = self.env[node.args[0]]
        return self.block_builder.emit(no_grad(x)) if node.meta["val"].is_floating_point() else x

    def _slice_traced(self, default: Callable) -> Callable:
        """``x[..., start:end:step]`` as the trace sized it: in bounds by construction (torch clamped
        it), so ``strided_slice`` need not clamp; clamping with symbolic sizes writes the length as
        ``min(s0, 512)``, which Relax cannot prove equal to ``s0``, and the sums downstream (position
        embeddings) lose their shapes."""
        def convert(node: torch.fx.Node) -> relax.Expr:
            args = list(node.args) + [None] * (5 - len(node.args))
            x_val, out_val = node.args[0].meta["val"], node.meta["val"]
            dim = (args[1] or 0) % x_val.dim()
            start, step = args[2], args[4] or 1
            length = out_val.shape[dim]
            if start is None:
                start = 0
            if not isinstance(start, int) or isinstance(length, int) and length == 0:
                return default(node)  # a symbolic start (the default converter's clamps are needed)
            if start < 0:
                start = max(start + x_val.shape[dim], 0)
            end = start + step * (length - 1) + 1
            x = self.env[node.args[0]]
            if start == 0 and step == 1 and str(length) == str(x_val.shape[dim]):
                return x  # the whole axis (a mask cut to a length it already has)
            return self.block_builder.emit(relax.op.strided_slice(
                x, [dim], [self.prim(start)], [self.prim(end)], [step], assume_inbound=True))
        return convert

    def _slice_scatter_traced(self, default: Callable) -> Callable:
        """``x[..., start:end] = src`` (step 1) as ``cat(x[..., :start], src, x[..., end:])``:
        Relax has no gradient for ``slice_scatter``, and the default writes a symbolic end
        (``shift_tokens_right``'s ``x[:, 1:] = ids[:, :-1]`` at any length) as a scalar argument;
        here every bound is static or the axis's end."""
        def convert(node: torch.fx.Node) -> relax.Expr:
            names_ = ("input", "src", "dim", "start", "end", "step")
            args = dict(zip(names_, node.args)) | dict(node.kwargs)
            x_val, src_val = node.args[0].meta["val"], args["src"].meta["val"]
            dim = (args.get("dim") or 0) % x_val.dim()
            size, length = x_val.shape[dim], src_val.shape[dim]
            start = args.get("start") or 0
            if (args.get("step") or 1) != 1 or not isinstance(start, int) or (start < 0 and not isinstance(size, int)):
                return default(node)
            start = max(start + size, 0) if start < 0 else start
            end = start + length
            x, src = self.env[node.args[0]], self.env[args["src"]]
            parts = [relax.op.strided_slice(x, [dim], [0], [start], assume_inbound=True)] if start > 0 else []
            parts.append(src)
            if str(end) != str(size):
                if not (isinstance(end, int) and isinstance(size, int)):
                    return default(node)
                parts.append(relax.op.strided_slice(x, [dim], [end], [size], assume_inbound=True))
            return self.block_builder.emit(relax.op.concat(parts, axis=dim)) if len(parts) > 1 else src
        return convert

    def _repeat_traced(self, default: Callable) -> Callable:
        """``x.repeat(r0, r1, ...)`` with a symbolic count (DeBERTa repeats its relative positions
        per batch and head) as ``x`` viewed as ``(1, s0, 1, s1, ...)``, broadcast to
        ``(r0, s0, r1, s1, ...)`` and merged pairwise: ``tile`` takes integer counts only."""
        def convert(node: torch.fx.Node) -> relax.Expr:
            reps = [r.meta["val"] if isinstance(r, torch.fx.Node) else r for r in node.args[1]]
            val = node.args[0].meta["val"]
            if all(isinstance(r, int) for r in reps):
                return default(node)
            sizes = [1] * (len(reps) - val.dim()) + list(val.shape)
            reps, sizes = [self.prim(r) for r in reps], [self.prim(d) for d in sizes]
            x = relax.op.reshape(self.env[node.args[0]], [d for size in sizes for d in (1, size)])
            wide = relax.op.broadcast_to(x, [d for r, size in zip(reps, sizes) for d in (r, size)])
            return self.block_builder.emit(relax.op.reshape(wide, [r * size for r, size in zip(reps, sizes)]))
        return convert

    def _squeeze_traced(self, node: torch.fx.Node) -> relax.Expr:
        """``squeeze`` as a reshape to the shape the trace gave it: ATen drops only the listed axes
        of size 1, and with a symbolic axis listed (``squeeze(x, [0, 1])`` on a (batch, 1) gather
        in mBART's ``shift_tokens_right``) TVM's converter dropped the batch axis too: every row
        then read row 0's value."""
        shape = [self.prim(d) for d in node.meta["val"].shape]
        return self.block_builder.emit(relax.op.reshape(self.env[node.args[0]], shape))

    def _index_put_mask(self, default: Callable) -> Callable:
        """``x[mask] = v`` with one boolean mask over leading axes and a value that broadcasts over
        the rest (wav2vec2 writes a learned vector where time steps are masked) as a ``where``:
        TVM's converter wants integer indices. Each masked place is written once, so
        ``accumulate`` adds ``v`` there."""
        def convert(node: torch.fx.Node) -> relax.Expr:
            x_arg, indices, value_arg = node.args[:3]
            accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
            x_val = x_arg.meta["val"]
            mask = indices[0] if len(indices) == 1 else None
            m_val = mask.meta["val"] if isinstance(mask, torch.fx.Node) else None
            v_val = value_arg.meta["val"]
            if (m_val is None or m_val.dtype != torch.bool or m_val.dim() > x_val.dim()
                    or tuple(map(str, m_val.shape)) != tuple(map(str, x_val.shape[:m_val.dim()]))
                    or v_val.dim() > x_val.dim() - m_val.dim()):
                return default(node)
            x, value = self.env[x_arg], self.env[value_arg]
            rest = x_val.dim() - m_val.dim()
            cond = relax.op.reshape(self.env[mask], [self.prim(d) for d in m_val.shape] + [1] * rest)
            new = relax.op.add(x, value) if accumulate else value
            return self.block_builder.emit(relax.op.where(cond, new, x))
        return convert

    def _arange_traced(self, default: Callable) -> Callable:
        """``arange`` of a symbolic length (``arange(seq)`` for positions and masks) as
        ``start + step * (cumsum(ones(n)) - 1)``: the length in a shape, which every pass and
        schedule downstream reads, not in scalar arguments."""
        def convert(node: torch.fx.Node) -> relax.Expr:
            val = node.meta["val"]
            args = list(node.args)
            start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
            if val.dim() != 1 or isinstance(val.shape[0], int) or not all(type(v) is int for v in (start, step)):
                return default(node)
            ones = relax.op.ones(relax.ShapeExpr([self.prim(val.shape[0])]), "int64")
            index = relax.op.subtract(relax.op.cumsum(ones, axis=0), relax.const(1, "int64"))
            value = relax.op.add(relax.const(start, "int64"), relax.op.multiply(relax.const(step, "int64"), index))
            dtype = str(val.dtype).removeprefix("torch.")
            return self.block_builder.emit(value if dtype == "int64" else relax.op.astype(value, dtype))
        return convert

    @staticmethod
    def _named(name: str, fn: Callable) -> Callable:
        def convert(node: torch.fx.Node, *rest: Any) -> Any:
            try:
                with stage_errors("convert", op=name, what=f"the Relax frontend failed on {node.format_node()}",
                                  error=UnsupportedOpError):
                    return fn(node, *rest)
            except ConversionError as exc:
                exc.sources = exc.sources or origins([node])
                raise
        return convert

    # --- randomness: a per-call input for every random value ------------------------------------
    def random_input(self, site: RandomSite, dtype: str, shape: list) -> relax.Var:
        """A marker for the ``len(random_sites)``-th random input (``passes.random`` makes it a
        function parameter)."""
        index = len(self.random_sites)
        self.random_sites.append(site)
        return self.block_builder.emit(relax.op.call_pure_packed(
            names.RANDOM_SITE, relax.prim_value(index), ty_args=relax.TensorType(shape, dtype)))

    def convert_random(self, node: torch.fx.Node) -> relax.Var:
        """Any other random op: replayed per call when its tensor arguments give only a layout."""
        name = f"{node.target.__name__}"
        tensor_args = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
        if name in _RNN_OPS:
            raise UnsupportedOpError(
                "convert", f"{name.split('.')[0]} with dropout between its layers in train mode draws its masks "
                "inside ATen's fused kernel, which the bridge cannot replay; set the RNN's dropout to 0 (or put "
                "an nn.Dropout between single-layer RNNs), or use fallback=True", op=name)
        if tensor_args and name not in _SHAPE_ONLY_RANDOM:
            raise UnsupportedOpError(
                "convert", f"random op {name} draws from values the module computes; only random ops "
                "whose tensor arguments give a shape can become per-call inputs (use fallback=True)", op=name)
        val = node.meta["val"]
        site = RandomSite("op", _dims(val.shape), _dims(val.stride()), val.dtype, op=node.target,
                          args=tuple(_meta(a) for a in node.args),
                          kwargs={k: _meta(v) for k, v in node.kwargs.items()})
        return self.random_input(site, str(val.dtype).removeprefix("torch."), [self.prim(d) for d in val.shape])

    def _dropout_expr(self, node: torch.fx.Node) -> relax.Expr:
        x = self.env[node.args[0]]
        if not is_train_dropout(node):
            return x
        if _uses_of_item(node, 1) and node.target.__name__ == "native_dropout.default":
            raise UnsupportedOpError("convert", "the boolean mask output of native_dropout is used", op="native_dropout")
        val = node.args[0].meta["val"]
        site = RandomSite("dropout", _dims(val.shape), _dims(val.stride()), val.dtype, p=float(node.args[1]))
        # the mask's shape from the trace (a Relax type after a tuple getitem may not carry one)
        mask = self.random_input(site, str(val.dtype).removeprefix("torch."), [self.prim(d) for d in val.shape])
        return self.block_builder.emit(relax.op.multiply(x, mask))

    def _dropout_value(self, node: torch.fx.Node) -> relax.Expr:
        return self._dropout_expr(node)

    def _dropout_tuple(self, node: torch.fx.Node) -> relax.Expr:
        out = self._dropout_expr(node)
        return self.block_builder.emit(relax.Tuple([out, out]))

    def _empty_traced_shape(self, node: torch.fx.Node) -> relax.Expr:
        """``empty(sizes)`` at its traced shape (sizes may be symbolic: ``x.new_empty(x.shape[0], 1)``)."""
        val = node.meta["val"]
        shape = [self.prim(d) for d in val.shape]
        return self.block_builder.emit(relax.op.zeros(shape, str(val.dtype).removeprefix("torch.")))

    # --- matmuls in the input's dtype -----------------------------------------------------------
    def _matmul(self, node: torch.fx.Node) -> relax.Var:
        a, b = self.env[node.args[0]], self.env[node.args[1]]
        return self.block_builder.emit(relax.op.matmul(a, b, out_dtype=str(a.ty.dtype)))

    def _addmm_keep_dtype(self, node: torch.fx.Node) -> relax.Var:
        bias, a, b = (self.env[n] for n in node.args[:3])
        alpha = node.kwargs.get("alpha", 1)
        beta = node.kwargs.get("beta", 1)
        dtype = str(a.ty.dtype)
        bb = self.block_builder
        res = bb.emit(relax.op.matmul(a, b, out_dtype=dtype))
        if alpha != 1:
            res = bb.emit(relax.op.multiply(res, relax.const(alpha, dtype)))
        if beta == 0:
            return res
        if beta != 1:
            bias = bb.emit(relax.op.multiply(bias, relax.const(beta, dtype)))
        return bb.emit(relax.op.add(res, bias))  # matmul first: the form CombineParallelMatmul matches

    def _linear_keep_dtype(self, node: torch.fx.Node) -> relax.Var:
        args = self.retrieve_args(node)
        bias = args[2] if len(args) > 2 else None
        return self.block_builder.emit(relax.op.linear(args[0], args[1], bias, str(args[0].ty.dtype)))

    # --- embedding: clipped reads, a range flag, no gradient at padding_idx ----------------------
    def _embedding(self, node: torch.fx.Node) -> relax.Expr:
        weight, indices = self.env[node.args[0]], self.env[node.args[1]]
        padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        scale = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_grad_by_freq", False)
        sparse = node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse", False)
        if scale or sparse:
            raise UnsupportedOpError("convert", "embedding with scale_grad_by_freq or sparse gradients", op="embedding")
        bb = self.block_builder
        rows = int(weight.ty.shape[0])
        idx = bb.emit(relax.op.astype(indices, "int64"))
        low = relax.op.greater_equal(idx, relax.const(0, "int64"))
        high = relax.op.less(idx, relax.const(rows, "int64"))
        self.index_checks.append(bb.emit(relax.op.min(relax.op.astype(relax.op.logical_and(low, high), "int32"))))
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

    def _gather_checked(self, node: torch.fx.Node) -> relax.Expr:
        """``gather`` (and so ``cross_entropy``'s pick of the target class) with the embedding's
        guard: clipped indices and a flag, so a class index out of range raises like PyTorch
        instead of reading out of bounds. Negative indices are out of range for ``gather``."""
        x, index = self.env[node.args[0]], self.env[node.args[2]]
        axis = int(node.args[1]) % max(len(x.ty.shape), 1)
        if node.kwargs.get("sparse_grad", False) or (len(node.args) > 3 and node.args[3]):
            raise UnsupportedOpError("convert", "gather with sparse_grad=True", op="gather")
        bb = self.block_builder
        idx = bb.emit(relax.op.astype(index, "int64"))
        size = x.ty.shape[axis] if x.ty.shape else 1
        clipped = bb.emit(relax.op.clip(idx, relax.prim_value(0), relax.prim_value(size - 1)))
        self.index_checks.append(bb.emit(relax.op.min(relax.op.astype(relax.op.equal(idx, clipped), "int32"))))
        return bb.emit(relax.op.gather_elements(x, clipped, axis=axis))

    def _cat_legacy_empty(self, node: torch.fx.Node) -> relax.Expr:
        """``cat`` skips empty parts: 1-D empty tensors whatever the others' rank (PyTorch's legacy
        rule, which transformers' key/value cache relies on: it starts from ``torch.tensor([])``),
        and parts of size 0 along the axis (a partial-rotary model's ``x[..., rot:]`` when the
        rotation covers the whole head). TVM has no empty tensors; these add nothing."""
        parts = [self.env[n] for n in node.args[0]]
        vals = [n.meta["val"] for n in node.args[0]]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        kept = [p for p, v in zip(parts, vals) if not _empty_cat_part(v, dim)] or parts[:1]
        if len(kept) == 1:
            return kept[0]
        return self.block_builder.emit(relax.op.concat(kept, axis=dim))

    def _select_wrapped(self, node: torch.fx.Node) -> relax.Expr:
        """``x.select(dim, i)`` (``x[:, -1]``): the frontend reads a negative ``i`` out of bounds
        (``take`` in its unchecked mode); read it as Python does, from the end."""
        x, dim, index = self.env[node.args[0]], int(node.args[1]), int(node.args[2])
        mode = "wrap" if index < 0 else "clip"  # in range: export checked it; "clip" needs no warning
        return self.block_builder.emit(relax.op.take(x, relax.const(index, "int64"), axis=dim, mode=mode))

    # --- pooling: what the frontend would ignore -------------------------------------------------
    def _avg_pool2d_checked(self, node: torch.fx.Node) -> relax.Expr:
        """``divisor_override`` (which the frontend ignores): without ceil_mode and with padding
        counted, every window has kh*kw elements, so the sum over ``d`` is the mean times kh*kw/d."""
        names_ = ("self", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
        given = {**dict(zip(names_, node.args)), **node.kwargs}
        divisor = given.get("divisor_override")
        out = self._avg_pool2d(node)
        if divisor is None:
            return out
        if given.get("ceil_mode", False) or not given.get("count_include_pad", True):
            raise UnsupportedOpError(
                "convert", "avg_pool2d with divisor_override and ceil_mode or count_include_pad=False", op="avg_pool2d")
        kernel = given["kernel_size"]
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else (kernel[0], kernel[-1])
        scale = relax.const(kh * kw / float(divisor), str(out.ty.dtype))
        return self.block_builder.emit(relax.op.multiply(out, scale))

    def _max_pool_values_only(self, convert: Callable) -> Callable:
        def values_only(node: torch.fx.Node) -> relax.Expr:
            if _uses_of_item(node, 1):
                raise UnsupportedOpError(
                    "convert", f"{node.target.__name__}: the indices output (return_indices=True) is not "
                    "supported; use fallback=True", op=node.target.__name__)
            return convert(node)
        return values_only

    # --- nn and layout ops the frontend lacks or gets wrong (issue 14) ---------------------------
    def _nn_converters(self, table: dict[str, Callable]) -> dict[str, Callable]:
        """The converters of this section by aten op (``table``: the frontend's, which some wrap)."""
        refuse = self._refuse_op
        return {
            "convolution.default": self._convolution_keep_dtype,
            "hardtanh.default": self._hardtanh_exact,
            "hardtanh_.default": self._hardtanh_exact,
            "clamp.default": self._clamp_scalars,
            "clamp_min.default": self._clamp_scalars,
            "clamp_max.default": self._clamp_scalars,
            "clamp.Tensor": self._clamp_tensor,
            "elu.default": self._elu_exact,
            "getitem": self._getitem_checked(table["getitem"]),
            "take.default": self._take_flat,
            "index.Tensor": self._index_from_end(table["index.Tensor"]),
            "amax.default": self._extreme(relax.op.max),
            "amin.default": self._extreme(relax.op.min),
            "sum.dim_IntList": self._zero_dim_safe(table["sum.dim_IntList"]),
            "mean.dim": self._zero_dim_safe(table["mean.dim"]),
            "index_select.default": self._zero_dim_safe(table["index_select.default"]),
            "linalg_vector_norm.default": self._vector_norm(table["linalg_vector_norm.default"]),
            "native_group_norm.default": self._group_norm,
            "constant_pad_nd.default": self._constant_pad,
            "upsample_nearest2d.vec": self._upsample,
            "upsample_nearest2d.default": self._upsample,
            "upsample_bilinear2d.vec": self._upsample,
            "upsample_bilinear2d.default": self._upsample,
            "_upsample_bilinear2d_aa.default": refuse(
                "antialiased interpolation (TVM's frontend would convert it as plain bilinear, wrong when "
                "downsampling)"),
            "upsample_bicubic2d.vec": refuse("bicubic interpolation (no exact conversion yet)"),
        }

    @staticmethod
    def _refuse_op(what: str) -> Callable:
        def refuse(node: torch.fx.Node) -> relax.Expr:
            raise UnsupportedOpError("convert", f"{what} is not supported; use fallback=True to keep PyTorch",
                                     op=node.target.__name__)
        return refuse

    def _out_dtype(self, node: torch.fx.Node) -> str:
        return str(node.meta["val"].dtype).removeprefix("torch.")

    def _convolution_keep_dtype(self, node: torch.fx.Node) -> relax.Expr:
        """``aten.convolution`` in the input's dtype (the frontend fixes float32, so a float64
        convolution does not even convert): 1-3-D, transposed 1-D and 2-D."""
        x, w = self.env[node.args[0]], self.env[node.args[1]]
        bias = node.args[2]
        stride, padding, dilation, transposed, out_pad, groups = node.args[3:9]
        ndim = len(x.ty.shape) - 2
        dtype = str(x.ty.dtype)
        layouts = {1: ("NCW", "W"), 2: ("NCHW", "HW"), 3: ("NCDHW", "DHW")}
        if ndim not in layouts or (transposed and ndim == 3):
            raise UnsupportedOpError("convert", f"a {ndim}-D {'transposed ' if transposed else ''}convolution",
                                     op="convolution")
        data_layout, space = layouts[ndim]
        common = dict(strides=list(stride), padding=list(padding), dilation=list(dilation), groups=int(groups),
                      data_layout=data_layout, out_dtype=dtype)
        if transposed:
            fn = {1: relax.op.nn.conv1d_transpose, 2: relax.op.nn.conv2d_transpose}[ndim]
            out = fn(x, w, output_padding=list(out_pad), kernel_layout="IO" + space, **common)
        else:
            fn = {1: relax.op.nn.conv1d, 2: relax.op.nn.conv2d, 3: relax.op.nn.conv3d}[ndim]
            out = fn(x, w, kernel_layout="OI" + space, **common)
        out = self.block_builder.emit(out)
        if bias is None:
            return out
        b = relax.op.reshape(self.env[bias], [1, -1] + [1] * ndim)
        return self.block_builder.emit(relax.op.add(out, b))

    def _hardtanh_exact(self, node: torch.fx.Node) -> relax.Expr:
        """``hardtanh(x, lo, hi)`` (and so ``relu6``, ``hardswish``, ``hardsigmoid``): the frontend
        makes it ``clip``, whose gradient (``clamp``'s) passes at the bounds where ATen's
        ``hardtanh_backward`` does not: ``where(x <= lo, lo, where(x >= hi, hi, x))``."""
        x = self.env[node.args[0]]
        given = {**dict(zip(("self", "min_val", "max_val"), node.args)), **node.kwargs}
        dtype = str(x.ty.dtype)
        lo = relax.const(given.get("min_val", -1.0), dtype)
        hi = relax.const(given.get("max_val", 1.0), dtype)
        op = relax.op
        return self.block_builder.emit(op.where(op.less_equal(x, lo), lo, op.where(op.greater_equal(x, hi), hi, x)))

    def _clamp_scalars(self, node: torch.fx.Node) -> relax.Expr:
        """``clamp``/``clamp_min``/``clamp_max`` with number bounds, in the result's dtype (an int
        tensor clamped to a float is a float tensor). An integer tensor's missing bound is its
        dtype's limit: the frontend's ``inf`` does not build for integers."""
        name = node.target.__name__
        if name.startswith(("clamp_min", "clamp_max")):
            bounds = (node.args[1], None) if name.startswith("clamp_min") else (None, node.args[1])
        else:
            given = {**dict(zip(("self", "min", "max"), node.args)), **node.kwargs}
            bounds = (given.get("min"), given.get("max"))
        dtype = self._out_dtype(node)
        x = self.env[node.args[0]]
        if str(x.ty.dtype) != dtype:
            x = self.block_builder.emit(relax.op.astype(x, dtype))
        if dtype.startswith(("int", "uint")):
            info = np.iinfo(dtype)
            lo, hi = (int(b) if b is not None else d for b, d in zip(bounds, (info.min, info.max)))
        else:
            lo, hi = (float(b) if b is not None else d for b, d in zip(bounds, (-math.inf, math.inf)))
        return self.block_builder.emit(relax.op.clip(x, lo, hi))

    def _clamp_tensor(self, node: torch.fx.Node) -> relax.Expr:
        """``clamp`` with tensor bounds as ``where``s, so each of ``x``, ``min`` and ``max`` gets
        the gradient where PyTorch gives it (the frontend's ``maximum``/``minimum`` would split it
        at ties)."""
        given = {**dict(zip(("self", "min", "max"), node.args)), **node.kwargs}
        dtype = self._out_dtype(node)
        bb, op = self.block_builder, relax.op
        x = bb.emit(op.astype(self.env[given["self"]], dtype))
        lo, hi = (None if given.get(k) is None else bb.emit(op.astype(self.env[given[k]], dtype)) for k in ("min", "max"))
        out = x if lo is None else bb.emit(op.where(op.less(x, lo), lo, x))
        if hi is None:
            return out
        over = op.greater(x, hi) if lo is None else op.logical_or(op.greater(x, hi), op.less(hi, lo))
        return bb.emit(op.where(over, hi, out))

    def _elu_exact(self, node: torch.fx.Node) -> relax.Expr:
        """``elu(x, alpha, scale, input_scale)`` as ATen: the exponential branch for ``x <= 0``
        (so at 0 the gradient is ``alpha * scale * input_scale``; the frontend's relu form gives
        another), read at ``min(x, 0)`` so an overflow in the branch not taken cannot reach the
        gradient as NaN."""
        given = {**dict(zip(("self", "alpha", "scale", "input_scale"), node.args)), **node.kwargs}
        x = self.env[given["self"]]
        dtype, op = str(x.ty.dtype), relax.op
        alpha, scale, in_scale = (float(given.get(k, 1.0)) for k in ("alpha", "scale", "input_scale"))
        positive = op.greater(x, relax.const(0.0, dtype))
        neg = op.where(positive, relax.const(0.0, dtype), x)
        expm1 = op.subtract(op.exp(op.multiply(neg, relax.const(in_scale, dtype))), relax.const(1.0, dtype))
        branch = op.multiply(expm1, relax.const(alpha * scale, dtype))
        return self.block_builder.emit(op.where(positive, op.multiply(x, relax.const(scale, dtype)), branch))

    def _getitem_checked(self, convert: Callable) -> Callable:
        """``out[i]`` of a multi-output op whose converter made one tensor (``native_layer_norm``'s
        mean and rstd): the frontend's ``getitem`` returns that tensor for every ``i``, a silently
        wrong value for ``i > 0``; refused instead."""
        def getitem(node: torch.fx.Node) -> relax.Expr:
            source, index = node.args[0], node.args[1]
            value = self.env.get(source) if isinstance(source, torch.fx.Node) else None
            multi = isinstance(getattr(source, "meta", {}).get("val"), (list, tuple))
            if multi and isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType) \
                    and isinstance(index, int) and index != 0:
                raise UnsupportedOpError(
                    "convert", f"output {index} of {source.target.__name__} (the converter gives only its first "
                    "output); use fallback=True", op=getattr(source.target, "__name__", str(source.target)))
            return convert(node)
        return getitem

    def _range_flag(self, inside: relax.Expr) -> None:
        """Fold ``all(inside)`` into one index-range flag for every ``take``/``x[idx]``: separate
        flags of equal index tensors would be equal outputs, which dedup merges."""
        bb, op = self.block_builder, relax.op
        flag = bb.emit(op.min(op.astype(inside, "int32")))
        slot = self.__dict__.get("range_flag_slot")
        if slot is None:
            self.range_flag_slot = len(self.index_checks)
            self.index_checks.append(flag)
        else:
            self.index_checks[slot] = bb.emit(op.minimum(self.index_checks[slot], flag))

    def _take_flat(self, node: torch.fx.Node) -> relax.Expr:
        """``torch.take``: indices into the flattened input, negative ones from the end; the
        frontend reads a negative one out of bounds. Clipped reads with the embedding's range
        flag, so an index out of range raises like PyTorch."""
        bb, op = self.block_builder, relax.op
        x, index = self.env[node.args[0]], self.env[node.args[1]]
        flat = bb.emit(op.reshape(x, [-1]))
        n = relax.const(int(math.prod(int(d) for d in x.ty.shape)), "int64")
        idx = bb.emit(op.astype(index, "int64"))
        self._range_flag(op.logical_and(op.greater_equal(idx, op.negative(n)), op.less(idx, n)))
        wrapped = bb.emit(op.where(op.less(idx, relax.const(0, "int64")), op.add(idx, n), idx))
        return bb.emit(op.take(flat, wrapped, axis=0, mode="clip"))

    def _index_from_end(self, convert: Callable) -> Callable:
        """``x[idx]`` (``index.Tensor``, and so ``torch.take``): the frontend reads a negative
        index out of bounds (``take`` in its unchecked mode). Each integer index tensor is read
        from the end where negative and checked against the axis (the embedding's range flag:
        out of range raises like PyTorch), then the frontend's conversion runs on those."""
        def index(node: torch.fx.Node) -> relax.Expr:
            x, bb, op = self.env[node.args[0]], self.block_builder, relax.op
            saved: dict[torch.fx.Node, relax.Expr] = {}
            for axis, idx_node in enumerate(node.args[1]):
                val = getattr(idx_node, "meta", {}).get("val")
                size = x.ty.shape[axis] if x.ty.shape is not None else None
                if val is None or val.dtype in (torch.bool, torch.uint8) or not isinstance(size, tvm.tirx.IntImm) \
                        or idx_node in saved:
                    continue
                n = relax.const(int(size), "int64")
                idx = bb.emit(op.astype(self.env[idx_node], "int64"))
                self._range_flag(op.logical_and(op.greater_equal(idx, op.negative(n)), op.less(idx, n)))
                saved[idx_node] = self.env[idx_node]
                self.env[idx_node] = bb.emit(op.where(op.less(idx, relax.const(0, "int64")), op.add(idx, n), idx))
            try:
                return convert(node)
            finally:
                self.env.update(saved)
        return index

    def _extreme(self, reduce: Callable) -> Callable:
        """``amax``/``amin``: the frontend has no converter (``logsumexp`` decomposes to one)."""
        def convert(node: torch.fx.Node) -> relax.Expr:
            x = self.env[node.args[0]]
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
            keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            if not x.ty.shape:  # 0-d: over "dim 0" is the value itself
                return self.block_builder.emit(relax.op.astype(x, str(x.ty.dtype)))
            axis = [dim] if isinstance(dim, int) else (list(dim) or None)
            return self.block_builder.emit(reduce(x, axis, keepdims=bool(keepdim)))
        return convert

    def _zero_dim_safe(self, convert: Callable) -> Callable:
        """Reductions and ``index_select`` over a 0-d tensor (dim 0 or -1 names the value itself),
        which Relax's axis checks refuse: the value, in the result's dtype and shape."""
        def zero_dim_safe(node: torch.fx.Node) -> relax.Expr:
            x = self.env[node.args[0]]
            if x.ty.shape is None or len(x.ty.shape) > 0:
                return convert(node)
            out = relax.op.astype(x, self._out_dtype(node))
            return self.block_builder.emit(relax.op.reshape(out, [int(d) for d in node.meta["val"].shape]))
        return zero_dim_safe

    def _vector_norm(self, convert: Callable) -> Callable:
        """``linalg_vector_norm``: ``ord=0`` (the frontend divides by it) counts the nonzeros,
        without gradient; any other finite ``ord > 0`` masks zeros so that the gradient is 0
        where PyTorch's is (an all-zero vector, and zero entries when ``ord < 1``) instead of NaN."""
        def norm(node: torch.fx.Node) -> relax.Expr:
            given = {**dict(zip(("self", "ord", "dim", "keepdim"), node.args)), **node.kwargs}
            p = float(given.get("ord", 2))
            if not (p == 0 or (0 < p < math.inf)):
                return convert(node)
            bb, op = self.block_builder, relax.op
            dtype = self._out_dtype(node)
            x = bb.emit(op.astype(self.env[given["self"]], dtype))
            dim = given.get("dim")
            axis = None if dim is None else ([dim] if isinstance(dim, int) else list(dim) or None)
            keep = bool(given.get("keepdim", False))
            zero, one = relax.const(0.0, dtype), relax.const(1.0, dtype)
            if p == 0:
                return bb.emit(op.sum(op.astype(op.not_equal(no_grad(x), zero), dtype), axis, keepdims=keep))
            a = bb.emit(op.abs(x))
            nonzero = op.not_equal(a, zero)
            powered = op.multiply(a, a) if p == 2 else op.where(nonzero, op.power(op.where(nonzero, a, one), relax.const(p, dtype)), zero)
            s = bb.emit(op.sum(powered, axis, keepdims=keep))
            empty = op.equal(s, zero)
            safe = op.where(empty, one, s)
            root = op.sqrt(safe) if p == 2 else op.power(safe, relax.const(1.0 / p, dtype))
            return bb.emit(op.where(empty, zero, root))
        return norm

    def _group_norm(self, node: torch.fx.Node) -> relax.Expr:
        """``native_group_norm`` as ``(out, mean, rstd)`` (the frontend returns ``out`` alone, so
        a use of the statistics would read ``out[1]``); float64 written out in arithmetic (TOPI's
        ``group_norm`` takes float32 and float16 only)."""
        x_node, w_node, b_node, n, c, _hw, groups, eps = node.args[:8]
        bb, op = self.block_builder, relax.op
        x = self.env[x_node]
        dtype, shape = str(x.ty.dtype), list(x.ty.shape)
        gamma = self.env[w_node] if w_node is not None else relax.const(np.ones(c, dtype), dtype)
        beta = self.env[b_node] if b_node is not None else relax.const(np.zeros(c, dtype), dtype)
        xr = bb.emit(op.reshape(x, [n, groups, -1]))
        mean = bb.emit(op.mean(xr, 2, keepdims=True))
        centered = bb.emit(op.subtract(xr, mean))
        rstd = bb.emit(op.rsqrt(op.add(op.mean(op.multiply(centered, centered), 2, keepdims=True),
                                       relax.const(eps, dtype))))
        if dtype in ("float32", "float16"):
            out = bb.emit(op.nn.group_norm(x, gamma, beta, groups, 1, list(range(2, len(shape))), eps))
        else:
            channel = [1, c] + [1] * (len(shape) - 2)
            out = bb.emit(op.reshape(op.multiply(centered, rstd), shape))
            out = bb.emit(op.add(op.multiply(out, op.reshape(gamma, channel)), op.reshape(beta, channel)))
        stats = [bb.emit(op.reshape(v, [n, groups])) for v in (mean, rstd)]
        return bb.emit(relax.Tuple([out, *stats]))

    def _constant_pad(self, node: torch.fx.Node) -> relax.Expr:
        """``constant_pad_nd`` with negative widths too (they crop; Relax's ``pad`` wants >= 0)."""
        x = self.env[node.args[0]]
        pads = list(node.args[1])
        value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0.0)
        shape = [self.prim(d) for d in node.args[0].meta["val"].shape]  # symbolic sizes too
        ndim = len(shape)
        widths = [0] * (2 * ndim)
        for i in range(len(pads) // 2):  # pairs from the last dim backwards
            axis = ndim - 1 - i
            widths[2 * axis], widths[2 * axis + 1] = int(pads[2 * i]), int(pads[2 * i + 1])
        bb = self.block_builder
        if any(w < 0 for w in widths):
            begin = [max(0, -widths[2 * a]) for a in range(ndim)]
            end = [shape[a] - max(0, -widths[2 * a + 1]) for a in range(ndim)]
            x = bb.emit(relax.op.strided_slice(x, list(range(ndim)), begin, end))
            widths = [max(0, w) for w in widths]
        if not any(widths):
            return bb.emit(relax.op.astype(x, str(x.ty.dtype)))
        return bb.emit(relax.op.nn.pad(x, widths, "constant", 0.0 if value is None else value))

    def _upsample(self, node: torch.fx.Node) -> relax.Expr:
        """``upsample_nearest2d``/``upsample_bilinear2d`` as ATen computes them (``resample``):
        a gather per axis, and for bilinear a weighted sum of two, the last axis first."""
        name = node.target.__name__
        linear, vec = "bilinear" in name, name.endswith(".vec")
        x = self.env[node.args[0]]
        if static_shape(x) is None:
            raise UnsupportedOpError("convert", "interpolation over a dynamic dimension", op=name)
        in_dims, out_dims = static_shape(x), [int(d) for d in node.meta["val"].shape]
        rest = list(node.args[2:])
        align = bool(rest.pop(0)) if linear else False
        if vec:
            scales = list(rest[0]) if rest and rest[0] is not None else [None, None]
        else:
            scales = (rest + [None, None])[:2]
        out = x
        for axis in (3, 2):
            out = self._resample_axis(out, axis, in_dims[axis], out_dims[axis], align, scales[axis - 2], linear)
        return out

    def _resample_axis(self, x: relax.Expr, axis: int, size: int, out: int, align: bool, scale: float | None,
                       linear: bool) -> relax.Expr:
        bb, op = self.block_builder, relax.op
        if not linear:
            idx = resample.nearest_indices(size, out, scale)
            return bb.emit(op.take(x, relax.const(idx, "int64"), axis=axis, mode="clip"))
        dtype = str(x.ty.dtype)
        taps = resample.linear_taps(size, out, align, scale, dtype)
        if taps is None:
            return x
        shape = [-1] + [1] * (len(x.ty.shape) - 1 - axis)
        parts = [op.multiply(op.take(x, relax.const(i, "int64"), axis=axis, mode="clip"),
                               relax.const(w.reshape(shape), dtype))
                 for i, w in ((taps.i0, taps.l0), (taps.i1, taps.l1))]
        return bb.emit(op.add(*parts))


def _origins_of(ep: ExportedProgram, chosen: Callable[[torch.fx.Node], bool]) -> tuple[str, ...]:
    """Where the chosen computing nodes came from (see ``provenance``)."""
    return origins(n for n in ep.graph.nodes if n.op == "call_function" and chosen(n))


def unsupported_ops(ep: ExportedProgram) -> list[str]:
    """aten ops in the graph that the importer has no converter for (random ops are all handled)."""
    known = BridgeImporter().convert_map
    return sorted({
        n.target.__name__ for n in ep.graph.nodes
        if n.op == "call_function" and n.target.__name__ not in known and not _is_random(n)
    })


# recurrent ops tagged random for their inter-layer dropout: random only when it is on
_RNN_OPS = {"lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input"}


def _is_random(node: torch.fx.Node) -> bool:
    if getattr(node.target, "__name__", "") in _RNN_OPS:
        dropout, train = node.args[5], node.args[6]
        return bool(train) and float(dropout) > 0
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _empty_cat_part(val: torch.Tensor, dim: int) -> bool:
    """A ``cat`` part that adds nothing: 1-D empty, or of size 0 along the axis."""
    if val.dim() == 1 and isinstance(val.shape[0], int) and val.shape[0] == 0:
        return True
    size = val.shape[dim] if -val.dim() <= dim < val.dim() else None
    return isinstance(size, int) and size == 0


def dropped_by_cat(node: torch.fx.Node, val: torch.Tensor) -> bool:
    """Every use of ``node`` is a ``cat`` (directly or through copies and casts) that drops it as
    an empty part (``BridgeImporter._cat_legacy_empty``)."""
    for user in node.users:
        name = getattr(user.target, "__name__", "")
        if name == "cat.default":
            dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
            if not _empty_cat_part(val, dim):
                return False
        elif name not in COPY_OPS or not dropped_by_cat(user, val):
            return False
    return bool(node.users)


def data_dependent_values(ep: ExportedProgram) -> list[str]:
    """Values whose shape holds a size no input shape gives (an unbacked symbol): what
    ``x[bool_mask]`` or ``nonzero`` returns, as ``"name = target (shape)"``."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found = []
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val.shape):
            found.append(f"{n.name} = {n.target} {tuple(val.shape)}")
    return found


def zero_size_values(ep: ExportedProgram) -> list[str]:
    """Values the graph uses that have a zero-size dimension (a parameter, a slice ``x[:, :0]``, a
    split part of size 0), as ``"name (shape)"``. Left out: outputs nothing reads (eval-mode
    batch norm's empty statistics), except a split's (Relax splits at every boundary), and an
    empty part only ``cat`` reads (``cat`` drops it, ``BridgeImporter._cat_legacy_empty``)."""
    found = []
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        many = isinstance(val, (list, tuple))
        split = many and getattr(node.target, "__name__", "").startswith(("split", "unbind"))
        used = {u.args[1] for u in node.users if u.target is operator.getitem and u.users} if many else set()
        for i, v in enumerate(val if many else [val]):
            if not isinstance(v, torch.Tensor) or not any(isinstance(d, int) and d == 0 for d in v.shape):
                continue
            if (not many and not node.users) or (many and not split and i not in used):
                continue
            if not many and dropped_by_cat(node, v):
                continue
            found.append(f"{node.name} ({', '.join(map(str, v.shape))})")
    return found


def to_relax(traced: TracedModule, converters: tuple = (), probe: bool = False) -> Converted:
    """Convert the traced program to Relax (function ``names.MAIN``): every input a parameter
    (the call's tensors, then the module's state), the outputs followed by one int32 flag per
    embedding (1: all indices were in range). ``converters``: (aten overload name, fn(node,
    importer)) pairs that replace the bridge's. ``probe``: also return every intermediate float
    tensor, after the flags (their fx node names in ``Converted.probes``)."""
    ep = traced.exported
    missing = unsupported_ops(ep)
    if missing:
        raise UnsupportedOpError(
            "convert", f"no Relax converter for {', '.join(missing)}; add one to "
            "tvmbridge.frontend.importer.BridgeImporter or call with fallback=True to keep PyTorch",
            op=missing[0], sources=_origins_of(ep, lambda n: getattr(n.target, "__name__", "") in missing),
        )
    dependent = data_dependent_values(ep)
    if dependent:
        raise ConversionError(
            "convert", f"{dependent[0]} has a size that depends on the values of a tensor (boolean-mask indexing "
            "x[mask], nonzero, masked_select, unique): compiled code needs sizes known from the input shapes; "
            "write it with torch.where (e.g. a loss over masked positions as a masked mean), or use fallback=True",
            sources=_origins_of(ep, lambda n: any(d.startswith(f"{n.name} = ") for d in dependent)))
    empty = zero_size_values(ep)
    if empty:
        raise ConversionError(
            "convert", f"{empty[0]} has a zero-size dimension: TVM's kernels and gradients do not handle empty "
            "tensors (wrong strides, unsorted split indices); call with fallback=True to keep PyTorch",
            sources=_origins_of(ep, lambda n: any(e.startswith(f"{n.name} (") for e in empty)))
    importer = BridgeImporter()
    random_ops = {n.target.__name__ for n in ep.graph.nodes
                  if n.op == "call_function" and _is_random(n) and n.target.__name__ not in _DROPOUT_OPS}
    custom = {name: importer._named(name, lambda node, _importer: importer.convert_random(node)) for name in random_ops}
    custom.update({name: importer._named(name, fn) for name, fn in converters})
    with stage_errors("convert"):
        mod = importer.from_exported_program(ep, True, False, False, custom)
    func = mod[names.MAIN]
    if len(func.params) != traced.num_user_inputs + len(traced.state.names):
        raise ConversionError("convert", f"unexpected Relax parameters {[p.name for p in func.params]}")
    func = func.without_attr("params")  # copies of the weights: the bridge passes live tensors
    probes = _probe_values(ep, importer.env, func) if probe else []
    if importer.index_checks or probes:
        func = _append_outputs(func, importer.index_checks + [v for _, v in probes])
    mod[names.MAIN] = func  # a module of our own, fresh from the frontend
    return Converted(mod, tuple(importer.random_sites), len(importer.index_checks), tuple(n for n, _ in probes))


def _probe_values(ep: ExportedProgram, env: dict, func: relax.Function) -> list[tuple[str, relax.Var]]:
    """(fx node name, Relax variable) of every non-empty float tensor the graph computes, in graph
    order, where the variable is a value of ``func``'s block."""
    bound = {b.var for b in only_dataflow_block(func, "convert").bindings}
    out = []
    for node in ep.graph.nodes:
        val, var = node.meta.get("val"), env.get(node)
        if (node.op == "call_function" and isinstance(val, torch.Tensor) and val.is_floating_point()
                and val.numel() and var in bound and isinstance(var.ty, relax.TensorType)):
            out.append((node.name, var))
    return out


def _append_outputs(func: relax.Function, extra: list[relax.Expr]) -> relax.Function:
    """``func`` returning its output tuple's fields and then ``extra`` (values of its block)."""
    block = only_dataflow_block(func, "convert")
    result = func.body.body
    value = {b.var: b.value for b in block.bindings}.get(result, result)
    fields = list(value.fields) if isinstance(value, relax.Tuple) else [result]
    out = relax.Var("outputs_and_checks", relax.TupleType([f.ty for f in fields + extra]))
    bindings = list(block.bindings) + [relax.VarBinding(out, relax.Tuple(fields + extra))]
    return rebuild(func, list(func.params), bindings, out)
