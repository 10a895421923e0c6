"""BatchNorm as ATen's CPU kernel computes it; ``native_group_norm`` with its statistics.

Train mode: the channel statistics summed in double and rounded where ATen rounds, the output as
ATen's ``x * alpha + beta`` rounded once (its fused multiply-add), the new running statistics with
the update's products kept out of a fused multiply-add (``kernels.barrier``); float32 outputs and
running statistics equal PyTorch's bit for bit for inputs with a spatial dimension, float64 ones
to rounding. The gradient is ATen's backward, not that of the forward as written
(:func:`_centered_gradient`).
Eval mode: the running statistics.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax.op.grad import no_grad

from ...errors import UnsupportedOpError
from ...ir import static_shape
from ...kernels.barrier import BARRIER
from .registry import args_of, converter

if TYPE_CHECKING:
    from ..importer import BridgeImporter


def _channel(importer: BridgeImporter, v: relax.Expr, ndim: int) -> relax.Expr:
    """A per-channel vector shaped to broadcast over (N, C, ...)."""
    return importer.block_builder.emit(relax.op.reshape(v, [1, -1] + [1] * (ndim - 2)))


def _c(value: float, dtype: str) -> relax.Expr:
    """A constant rounded to ``dtype`` first, as C++ rounds ``static_cast<float>(momentum)``."""
    return relax.const(np.array(value, dtype=dtype), dtype)


def _fused_multiply_add(bb: relax.BlockBuilder, x: relax.Expr, a: relax.Expr, b: relax.Expr) -> relax.Expr:
    """``x * a + b`` of float32 values rounded once, as a hardware FMA rounds (ATen's
    ``Vectorized::fmadd``): the product is exact in double, so the double sum rounded to float32
    is the FMA's result (up to a double rounding, once in about 2^29 values). Written out, since
    the CPU target has no FMA for LLVM to contract into (``devices.target_for``)."""
    x64, a64, b64 = (bb.emit(relax.op.astype(v, "float64")) for v in (x, a, b))
    total = bb.emit(relax.op.add(bb.emit(relax.op.multiply(x64, a64)), b64))
    return bb.emit(relax.op.astype(total, "float32"))


def _apply_affine(
    importer: BridgeImporter,
    x: relax.Expr,
    mean: relax.Expr,
    invstd: relax.Expr,
    weight: Any,
    bias: Any,
    centered: bool = False,
) -> relax.Expr:
    """``x * alpha + beta`` with ``alpha = invstd * w`` and ``beta = b - mean * alpha`` per
    channel, the form ATen's CPU kernel computes; ``centered`` (train mode): with the gradient
    of ``(x - mean) * alpha + b`` (:func:`_centered_gradient`)."""
    bb, env = importer.block_builder, importer.env
    dtype = str(x.ty.dtype)
    alpha = invstd if weight is None else bb.emit(relax.op.multiply(invstd, env[weight]))
    shift = bb.emit(relax.op.multiply(mean, alpha))
    beta = bb.emit(relax.op.negative(shift)) if bias is None else bb.emit(relax.op.subtract(env[bias], shift))
    ndim = len(x.ty.shape)
    scale, shift = (_channel(importer, bb.emit(relax.op.astype(v, dtype)), ndim) for v in (alpha, beta))
    if dtype == "float32":  # ATen's fmadd: one rounding, kept with the CPU target's FMA off
        out = _fused_multiply_add(bb, x, scale, shift)
    else:
        out = bb.emit(relax.op.add(bb.emit(relax.op.multiply(x, scale)), shift))
    return _centered_gradient(importer, out, x, mean, alpha, bias) if centered else out


def _centered_gradient(
    importer: BridgeImporter, out: relax.Expr, x: relax.Expr, mean: relax.Expr, alpha: relax.Expr, bias: Any
) -> relax.Expr:
    """``out`` (its value: ATen's bits) with the gradient of ``t = (x - mean) * alpha + b``
    computed in double: ``no_grad(out) + (t - no_grad(t))``, exactly ``out`` for a finite ``t``.

    Differentiated as written, ``x * alpha + (b - mean * alpha)`` gives ``alpha`` the gradient
    ``sum(g * x) - mean * sum(g)``: two sums that cancel wherever a channel's mean is large
    against its spread (BatchNorm over the 1x1 and 2x2 maps of a small batch), and float32
    sums over a whole channel in TVM's sequential order. Through ``t`` it is ATen's centered
    ``dotp = sum(g * (x - mean))``, and the channel sums (``dotp``, ``sum(g)``, the mean's
    gradient) are double, as ATen accumulates them (``accscalar_t``). After differentiation
    ``passes.gradient`` folds ``t - no_grad(t)`` to zeros: the forward computes nothing more.
    (Eval mode keeps the plain form: an inference compile is never differentiated.)"""
    bb, op = importer.block_builder, relax.op
    ndim, wide = len(x.ty.shape), "float64"

    def channel(v: relax.Expr) -> relax.Expr:
        return _channel(importer, bb.emit(op.astype(v, wide)), ndim)

    t = op.multiply(op.subtract(bb.emit(op.astype(x, wide)), channel(mean)), channel(alpha))
    if bias is not None:
        t = op.add(t, channel(importer.env[bias]))
    t = bb.emit(t)
    zero = bb.emit(op.astype(op.subtract(t, no_grad(t)), str(out.ty.dtype)))
    return bb.emit(op.add(no_grad(out), zero))


def _product(importer: BridgeImporter, c: float, v: relax.Expr) -> relax.Expr:
    """``c * v`` rounded to v's dtype and stored (``kernels.barrier``): fused with the add
    after it, LLVM could make one FMA of them, one rounding less than ATen's C++ (on a target
    that contracts: the build takes the barrier out where none can be made)."""
    bb = importer.block_builder
    product = bb.emit(relax.op.multiply(_c(c, str(v.ty.dtype)), v))
    return bb.emit(relax.op.call_pure_packed(BARRIER, product, ty_args=product.ty))


def _count(count: Any, dtype: str) -> relax.Expr:
    """A count of elements as a scalar of ``dtype``: a constant, or (over a symbolic batch) read
    from the shape at run time; the same value either way (counts below 2**24 are exact in
    float32), so the arithmetic rounds as ATen's does with its integer count."""
    if isinstance(count, int):
        return _c(count, dtype)
    return relax.op.astype(relax.op.reshape(relax.op.shape_to_tensor(relax.ShapeExpr([count])), ()), dtype)


def _batch_stats(importer: BridgeImporter, x: relax.Expr, eps: float) -> tuple[relax.Expr, relax.Expr, relax.Expr, Any]:
    """Per channel, as ATen's contiguous CPU kernel: the mean summed in double and rounded
    to float; the squared deviations from that float mean computed in float and summed in
    double, rounded to float; ``invstd = 1/sqrt(var_sum/n + eps)`` in double from the float
    ``var_sum/n``. Returns ``(mean, var_sum, invstd, n)``, ``n`` an int or, where a size is
    symbolic (a variant serving every batch size), an expression of the sizes."""
    bb = importer.block_builder
    dtype = str(x.ty.dtype)
    static = static_shape(x)
    shape = list(static) if static is not None else list(x.ty.shape)
    axes = [0] + list(range(2, len(shape)))
    count = math.prod(shape[a] for a in axes)
    if static is None and isinstance(count, tvm.tirx.IntImm):
        count = int(count)
    total = relax.op.sum(relax.op.astype(x, "float64"), axis=axes)  # sum / n: mean() scales by 1/n
    mean = bb.emit(relax.op.astype(relax.op.divide(total, _count(count, "float64")), dtype))
    dev = bb.emit(relax.op.subtract(x, _channel(importer, mean, len(shape))))
    squares = bb.emit(relax.op.astype(relax.op.multiply(dev, dev), "float64"))
    var_sum = bb.emit(relax.op.astype(relax.op.sum(squares, axis=axes), dtype))
    var = relax.op.astype(relax.op.divide(var_sum, _count(count, dtype)), "float64")
    invstd = relax.op.divide(relax.const(1.0, "float64"), relax.op.sqrt(relax.op.add(var, relax.const(eps, "float64"))))
    return mean, var_sum, bb.emit(relax.op.astype(invstd, dtype)), count


def _unbiased_count(count: Any) -> Any:
    """``max(n - 1, 1)``, ATen's divisor of the running variance."""
    return max(count - 1, 1) if isinstance(count, int) else tvm.tirx.max(count - 1, 1)


@converter("_native_batch_norm_legit_functional.default")
def batch_norm_train(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``(out, save_mean, save_invstd, new_running_mean, new_running_var)``; the running
    statistics as ATen's CPU kernel updates them (float and double where it uses each; a
    float64 input all in double)."""
    x_node, weight, bias, rm, rv, _training, momentum, eps = args_of(node)[:8]
    bb = importer.block_builder
    x = importer.env[x_node]
    dtype = _train_dtype(x)
    mean, var_sum, invstd, count = _batch_stats(importer, x, float(eps))
    out = _apply_affine(importer, x, mean, invstd, weight, bias, centered=True)
    running_mean, running_var = importer.env[rm], importer.env[rv]
    if dtype == "float64":
        m, keep = float(momentum), 1.0 - float(momentum)
        new_mean = bb.emit(relax.op.add(_product(importer, m, mean), _product(importer, keep, running_mean)))
        unbiased = bb.emit(relax.op.divide(var_sum, _count(_unbiased_count(count), dtype)))
        new_var = bb.emit(relax.op.add(_product(importer, m, unbiased), _product(importer, keep, running_var)))
        return bb.emit(relax.Tuple([out, mean, invstd, new_mean, new_var]))
    m = float(np.float32(momentum))
    keep = float(np.float32(1.0) - np.float32(momentum))
    new_mean = bb.emit(relax.op.add(_product(importer, m, mean), _product(importer, keep, running_mean)))
    unbiased = relax.op.astype(relax.op.divide(var_sum, _count(_unbiased_count(count), dtype)), "float64")
    new_var = bb.emit(
        relax.op.astype(
            relax.op.add(
                relax.op.multiply(relax.const(m, "float64"), unbiased),
                relax.op.astype(relax.op.multiply(_c(keep, dtype), running_var), "float64"),
            ),
            dtype,
        )
    )
    return bb.emit(relax.Tuple([out, mean, invstd, new_mean, new_var]))


def _train_dtype(x: relax.Expr) -> str:
    dtype = str(x.ty.dtype)
    if dtype not in ("float32", "float64"):
        raise UnsupportedOpError("convert", f"batch_norm in train mode on {dtype}", op="batch_norm")
    return dtype


@converter("_native_batch_norm_legit.no_stats")
def batch_norm_no_stats(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    x_node, weight, bias, _training, _momentum, eps = args_of(node)[:6]
    x = importer.env[x_node]
    _train_dtype(x)
    mean, _var_sum, invstd, _ = _batch_stats(importer, x, float(eps))
    out = _apply_affine(importer, x, mean, invstd, weight, bias, centered=True)
    return importer.block_builder.emit(relax.Tuple([out, mean, invstd]))


def _eval_norm(
    importer: BridgeImporter, x_node: Any, weight: Any, bias: Any, rm: Any, rv: Any, eps: float
) -> relax.Expr:
    """With the running statistics: ``invstd = 1 / sqrt(var + eps)`` in double, rounded to
    the statistics' dtype, as ATen computes it."""
    bb = importer.block_builder
    running_var = importer.env[rv]
    var = relax.op.add(relax.op.astype(running_var, "float64"), relax.const(eps, "float64"))
    invstd = relax.op.divide(relax.const(1.0, "float64"), relax.op.sqrt(var))
    invstd = bb.emit(relax.op.astype(invstd, str(running_var.ty.dtype)))
    return _apply_affine(importer, importer.env[x_node], importer.env[rm], invstd, weight, bias)


@converter("_native_batch_norm_legit_no_training.default")
def batch_norm_eval(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    x_node, weight, bias, rm, rv, _momentum, eps = args_of(node)[:7]
    out = _eval_norm(importer, x_node, weight, bias, rm, rv, float(eps))
    return importer.block_builder.emit(relax.Tuple([out, out, out]))


@converter("batch_norm.default")
def batch_norm_aten(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    x_node, weight, bias, rm, rv, training, _momentum, eps = args_of(node)[:8]
    if training or rm is None:
        raise UnsupportedOpError("convert", "batch_norm in training mode outside the functional form", op="batch_norm")
    return _eval_norm(importer, x_node, weight, bias, rm, rv, float(eps))


@converter("native_group_norm.default")
def group_norm(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``native_group_norm`` as ``(out, mean, rstd)`` (the frontend returns ``out`` alone, so
    a use of the statistics would read ``out[1]``), in arithmetic with two-pass statistics (the
    mean, then the mean square of the centered values), as ATen computes them. TOPI's
    ``group_norm`` takes the variance as ``E[x^2] - E[x]^2`` in float32, which cancels where the
    mean is large against the spread: outputs off by 0.5 where eager's are within 3e-5 (a group
    of mean 30 and deviation 0.05; PoolFormer's one-group norms). 16-bit inputs are normalized in
    float32, ATen's accumulation type, and rounded once."""
    x_node, w_node, b_node, _n, c, _hw, groups, eps = args_of(node)[:8]
    bb, op = importer.block_builder, relax.op
    x = importer.env[x_node]
    dtype, shape = str(x.ty.dtype), list(x.ty.shape)
    compute = "float32" if dtype in ("float16", "bfloat16") else dtype

    def widened(v: relax.Expr) -> relax.Expr:
        return v if compute == dtype else bb.emit(op.astype(v, compute))

    n = shape[0]  # the input's own batch size: symbolic in a variant serving every batch size
    gamma = importer.env[w_node] if w_node is not None else relax.const(np.ones(c, dtype), dtype)
    beta = importer.env[b_node] if b_node is not None else relax.const(np.zeros(c, dtype), dtype)
    xr = bb.emit(op.reshape(widened(x), [n, groups, -1]))
    mean = bb.emit(op.mean(xr, 2, keepdims=True))
    centered = bb.emit(op.subtract(xr, mean))
    rstd = bb.emit(
        op.rsqrt(op.add(op.mean(op.multiply(centered, centered), 2, keepdims=True), relax.const(eps, compute)))
    )
    channel = [1, c] + [1] * (len(shape) - 2)
    out = bb.emit(op.reshape(op.multiply(centered, rstd), shape))
    out = op.add(op.multiply(out, op.reshape(widened(gamma), channel)), op.reshape(widened(beta), channel))
    out = bb.emit(out if compute == dtype else op.astype(out, dtype))
    stats = [bb.emit(op.reshape(v if compute == dtype else op.astype(v, dtype), [n, groups])) for v in (mean, rstd)]
    return bb.emit(relax.Tuple([out, *stats]))
