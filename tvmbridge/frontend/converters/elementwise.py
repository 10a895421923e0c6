"""Elementwise ops with PyTorch's gradient at their edges: ``hardtanh`` (and so ``relu6``,
``hardswish``, ``hardsigmoid``), ``clamp`` with number or tensor bounds, ``elu``; and ``div``
with a rounding mode and a number, in the dtype PyTorch computes it in; ``hypot``; ``add``,
``sub`` and ``rsub`` with ``alpha``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tvm import relax

from .registry import args_of, converter, kwargs_of, op_name, out_dtype

if TYPE_CHECKING:
    from ..importer import BridgeImporter


@converter("hardtanh.default", "hardtanh_.default")
def hardtanh_exact(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``hardtanh(x, lo, hi)`` (and so ``relu6``, ``hardswish``, ``hardsigmoid``): the frontend
    makes it ``clip``, whose gradient (``clamp``'s) passes at the bounds where ATen's
    ``hardtanh_backward`` does not: ``where(x <= lo, lo, where(x >= hi, hi, x))``."""
    args, kwargs = args_of(node), kwargs_of(node)
    x = importer.env[args[0]]
    given = {**dict(zip(("self", "min_val", "max_val"), args)), **kwargs}
    dtype = str(x.ty.dtype)
    lo = relax.const(given.get("min_val", -1.0), dtype)
    hi = relax.const(given.get("max_val", 1.0), dtype)
    op = relax.op
    return importer.block_builder.emit(op.where(op.less_equal(x, lo), lo, op.where(op.greater_equal(x, hi), hi, x)))


@converter("clamp.default", "clamp_min.default", "clamp_max.default")
def clamp_scalars(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``clamp``/``clamp_min``/``clamp_max`` with number bounds, in the result's dtype (an int
    tensor clamped to a float is a float tensor). An integer tensor's missing bound is its
    dtype's limit: the frontend's ``inf`` does not build for integers."""
    args, kwargs = args_of(node), kwargs_of(node)
    name = op_name(node)
    if name.startswith(("clamp_min", "clamp_max")):
        bounds = (args[1], None) if name.startswith("clamp_min") else (None, args[1])
    else:
        given = {**dict(zip(("self", "min", "max"), args)), **kwargs}
        bounds = (given.get("min"), given.get("max"))
    dtype = out_dtype(node)
    x = importer.env[args[0]]
    if str(x.ty.dtype) != dtype:
        x = importer.block_builder.emit(relax.op.astype(x, dtype))
    lo: float  # an int for an integer tensor
    hi: float
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        lo, hi = (int(b) if b is not None else d for b, d in zip(bounds, (info.min, info.max)))
    else:
        lo, hi = (float(b) if b is not None else d for b, d in zip(bounds, (-math.inf, math.inf)))
    return importer.block_builder.emit(relax.op.clip(x, lo, hi))


@converter("clamp.Tensor")
def clamp_tensor(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``clamp`` with tensor bounds as ``where``s, so each of ``x``, ``min`` and ``max`` gets
    the gradient where PyTorch gives it (the frontend's ``maximum``/``minimum`` would split it
    at ties)."""
    args, kwargs = args_of(node), kwargs_of(node)
    given = {**dict(zip(("self", "min", "max"), args)), **kwargs}
    dtype = out_dtype(node)
    bb, op = importer.block_builder, relax.op
    x = bb.emit(op.astype(importer.env[given["self"]], dtype))
    lo, hi = (
        None if given.get(k) is None else bb.emit(op.astype(importer.env[given[k]], dtype)) for k in ("min", "max")
    )
    out = x if lo is None else bb.emit(op.where(op.less(x, lo), lo, x))
    if hi is None:
        return out
    over = op.greater(x, hi) if lo is None else op.logical_or(op.greater(x, hi), op.less(hi, lo))
    return bb.emit(op.where(over, hi, out))


@converter("elu.default")
def elu_exact(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``elu(x, alpha, scale, input_scale)`` as ATen: the exponential branch for ``x <= 0``
    (so at 0 the gradient is ``alpha * scale * input_scale``; the frontend's relu form gives
    another), read at ``min(x, 0)`` so an overflow in the branch not taken cannot reach the
    gradient as NaN."""
    args, kwargs = args_of(node), kwargs_of(node)
    given = {**dict(zip(("self", "alpha", "scale", "input_scale"), args)), **kwargs}
    x = importer.env[given["self"]]
    dtype, op = str(x.ty.dtype), relax.op
    alpha, scale, in_scale = (float(given.get(k, 1.0)) for k in ("alpha", "scale", "input_scale"))
    positive = op.greater(x, relax.const(0.0, dtype))
    neg = op.where(positive, relax.const(0.0, dtype), x)
    expm1 = op.subtract(op.exp(op.multiply(neg, relax.const(in_scale, dtype))), relax.const(1.0, dtype))
    branch = op.multiply(expm1, relax.const(alpha * scale, dtype))
    return importer.block_builder.emit(op.where(positive, op.multiply(x, relax.const(scale, dtype)), branch))


@converter("div.Tensor_mode", "div.Tensor", "div.Scalar", "mul.Tensor", "mul.Scalar", wraps_default=True)
def times_number(importer: BridgeImporter, node: torch.fx.Node, default: Any) -> relax.Expr:
    """``x * number`` and ``x / number`` (with or without a rounding mode: ``x // 2`` on a float
    tensor, a position table's ``arange(d) // 2``) as ATen computes them: in the result's dtype
    with the number unrounded, a float16/bfloat16 result in float32 and rounded once at the end
    (the frontend multiplies by the number rounded to bfloat16: ``x * 0.1`` differed in a fifth
    of its elements), and with a rounding mode, a number beside a tensor of any dtype (the
    frontend's int64 or float32 constant Relax refuses). Two tensors, or an integer result, and
    float32/float64 without a rounding mode keep TVM's conversion."""
    args, kwargs = args_of(node), kwargs_of(node)
    given = {**dict(zip(("self", "other", "rounding_mode"), args)), **kwargs}
    dtype = out_dtype(node)
    numbers = [k for k in ("self", "other") if not isinstance(given[k], torch.fx.Node)]
    rounding = op_name(node) == "div.Tensor_mode"
    if not numbers or not dtype.startswith(("float", "bfloat")) or not (rounding or dtype in ("float16", "bfloat16")):
        return default(node)
    compute = "float32" if dtype in ("float16", "bfloat16") else dtype
    bb, op = importer.block_builder, relax.op
    x, y = (_operand(importer, given[k], compute) for k in ("self", "other"))
    mode = given.get("rounding_mode")
    if op_name(node).startswith("mul"):
        out = bb.emit(op.multiply(x, y))
    elif mode == "floor":
        out = bb.emit(op.floor_divide(x, y))
    elif mode == "trunc":
        out = bb.emit(op.trunc(op.divide(x, y)))
    else:
        out = bb.emit(op.divide(x, y))
    return out if compute == dtype else bb.emit(op.astype(out, dtype))


@converter("hypot.default")
def hypot(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``hypot(a, b)`` as ``sqrt(a * a + b * b)`` (the frontend has none); gradient ``a / hypot``."""
    args = args_of(node)
    op, dtype = relax.op, out_dtype(node)
    a, b = (op.astype(importer.env[t], dtype) for t in args[:2])
    return importer.block_builder.emit(op.sqrt(op.add(op.multiply(a, a), op.multiply(b, b))))


def _operand(importer: BridgeImporter, value: Any, compute: str, read: Callable[[Any], Any] = float) -> relax.Expr:
    """An operand in the dtype an op computes in: a node's value cast, a number as the op reads
    it (``read``) as a constant."""
    if not isinstance(value, torch.fx.Node):
        return relax.const(read(value), compute)
    x = importer.env[value]
    return x if str(x.ty.dtype) == compute else importer.block_builder.emit(relax.op.astype(x, compute))


_SCALED_OPERAND = {  # op -> (the operand scaled by alpha, its sign): x + sign * alpha * y
    "add": ("other", 1),
    "sub": ("other", -1),
    "rsub": ("self", -1),
}


@converter("add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar", wraps_default=True)
def add_with_alpha(importer: BridgeImporter, node: torch.fx.Node, default: Any) -> relax.Expr:
    """``add``/``sub``/``rsub`` with ``alpha`` (``torch.add(x, y, alpha=0.1)``, ``buf.add_(x,
    alpha=0.1)``, ``x.sub_(y, alpha=lr)``): the frontend drops ``alpha`` (computes ``x + y``).
    ``x + alpha * y`` as ATen's kernel rounds it: ``alpha`` read in the tensor's dtype, float32
    as one fused multiply-add (here in float64, rounded once), float16/bfloat16 in float32;
    ``alpha == 1`` keeps TVM's conversion."""
    args, kwargs = args_of(node), kwargs_of(node)
    given = {**dict(zip(("self", "other", "alpha"), args)), **kwargs}
    alpha = given.get("alpha", 1)
    if alpha == 1:
        return default(node)
    scaled, sign = _SCALED_OPERAND[op_name(node).split(".")[0]]
    kept = "self" if scaled == "other" else "other"
    dtype = out_dtype(node)
    compute = {"float16": "float32", "bfloat16": "float32", "float32": "float64"}.get(dtype, dtype)
    bb, op = importer.block_builder, relax.op

    def operand(value: Any) -> relax.Expr:  # a number as ATen reads it: in the result's dtype
        return _operand(importer, value, compute, lambda v: torch.tensor(v, dtype=getattr(torch, dtype)).item())

    term = bb.emit(op.multiply(operand(given[scaled]), operand(sign * alpha)))
    out = bb.emit(op.add(operand(given[kept]), term))
    return out if compute == dtype else bb.emit(op.astype(out, dtype))
