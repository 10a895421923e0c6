"""BatchNorm as ATen's CPU kernel computes it, for the importer (``BridgeImporter`` mixes this in).

Train mode: the channel statistics summed in double and rounded where ATen rounds, the output as
ATen's ``x * alpha + beta``, the new running statistics with the update's products kept out of a
fused multiply-add (``kernels.barrier``); float32 outputs and running statistics equal PyTorch's
bit for bit for inputs with a spatial dimension, float64 ones to rounding. The gradient is ATen's
backward, not that of the forward as written (:meth:`BatchNormConverters._centered_gradient`).
Eval mode: the running statistics.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tvm import relax
from tvm.relax.op.grad import no_grad

from ..errors import UnsupportedOpError
from ..ir import static_shape
from ..kernels.barrier import BARRIER


class BatchNormConverters:
    """The batch-norm converters (``block_builder`` and ``env`` are the importer's)."""

    def _channel(self, v: relax.Expr, ndim: int) -> relax.Expr:
        """A per-channel vector shaped to broadcast over (N, C, ...)."""
        return self.block_builder.emit(relax.op.reshape(v, [1, -1] + [1] * (ndim - 2)))

    def _c(self, value: float, dtype: str) -> relax.Expr:
        """A constant rounded to ``dtype`` first, as C++ rounds ``static_cast<float>(momentum)``."""
        return relax.const(np.array(value, dtype=dtype), dtype)

    def _apply_affine(self, x: relax.Expr, mean: relax.Expr, invstd: relax.Expr, weight: Any, bias: Any,
                      centered: bool = False) -> relax.Expr:
        """``x * alpha + beta`` with ``alpha = invstd * w`` and ``beta = b - mean * alpha`` per
        channel, the form ATen's CPU kernel computes; ``centered`` (train mode): with the gradient
        of ``(x - mean) * alpha + b`` (:meth:`_centered_gradient`)."""
        bb = self.block_builder
        dtype = str(x.ty.dtype)
        alpha = invstd if weight is None else bb.emit(relax.op.multiply(invstd, self.env[weight]))
        shift = bb.emit(relax.op.multiply(mean, alpha))
        beta = (bb.emit(relax.op.negative(shift)) if bias is None
                else bb.emit(relax.op.subtract(self.env[bias], shift)))
        ndim = len(x.ty.shape)
        out = bb.emit(relax.op.multiply(x, self._channel(bb.emit(relax.op.astype(alpha, dtype)), ndim)))
        out = bb.emit(relax.op.add(out, self._channel(bb.emit(relax.op.astype(beta, dtype)), ndim)))
        return self._centered_gradient(out, x, mean, alpha, bias) if centered else out

    def _centered_gradient(self, out: relax.Expr, x: relax.Expr, mean: relax.Expr, alpha: relax.Expr,
                           bias: Any) -> relax.Expr:
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
        bb, op = self.block_builder, relax.op
        ndim, wide = len(x.ty.shape), "float64"

        def channel(v: relax.Expr) -> relax.Expr:
            return self._channel(bb.emit(op.astype(v, wide)), ndim)

        t = op.multiply(op.subtract(bb.emit(op.astype(x, wide)), channel(mean)), channel(alpha))
        if bias is not None:
            t = op.add(t, channel(self.env[bias]))
        t = bb.emit(t)
        zero = bb.emit(op.astype(op.subtract(t, no_grad(t)), str(out.ty.dtype)))
        return bb.emit(op.add(no_grad(out), zero))

    def _product(self, c: float, v: relax.Expr) -> relax.Expr:
        """``c * v`` rounded to v's dtype and stored (``kernels.barrier``): fused with the add
        after it, LLVM could make one FMA of them, one rounding less than ATen's C++."""
        bb = self.block_builder
        product = bb.emit(relax.op.multiply(self._c(c, str(v.ty.dtype)), v))
        return bb.emit(relax.op.call_pure_packed(BARRIER, product, ty_args=product.ty))

    def _batch_stats(self, x: relax.Expr, eps: float) -> tuple[relax.Expr, relax.Expr, relax.Expr, int]:
        """Per channel, as ATen's contiguous CPU kernel: the mean summed in double and rounded
        to float; the squared deviations from that float mean computed in float and summed in
        double, rounded to float; ``invstd = 1/sqrt(var_sum/n + eps)`` in double from the float
        ``var_sum/n``. Returns ``(mean, var_sum, invstd, n)``."""
        bb = self.block_builder
        dtype = str(x.ty.dtype)
        shape = static_shape(x)
        if shape is None:
            raise UnsupportedOpError("convert", "batch_norm in train mode over a dynamic dimension", op="batch_norm")
        axes = [0] + list(range(2, len(shape)))
        count = math.prod(shape[a] for a in axes)
        total = relax.op.sum(relax.op.astype(x, "float64"), axis=axes)  # sum / n: mean() scales by 1/n
        mean = bb.emit(relax.op.astype(relax.op.divide(total, relax.const(float(count), "float64")), dtype))
        dev = bb.emit(relax.op.subtract(x, self._channel(mean, len(shape))))
        squares = bb.emit(relax.op.astype(relax.op.multiply(dev, dev), "float64"))
        var_sum = bb.emit(relax.op.astype(relax.op.sum(squares, axis=axes), dtype))
        var = relax.op.astype(relax.op.divide(var_sum, self._c(count, dtype)), "float64")
        invstd = relax.op.divide(relax.const(1.0, "float64"), relax.op.sqrt(relax.op.add(var, relax.const(eps, "float64"))))
        return mean, var_sum, bb.emit(relax.op.astype(invstd, dtype)), count

    def _batch_norm_train(self, node: torch.fx.Node) -> relax.Expr:
        """``(out, save_mean, save_invstd, new_running_mean, new_running_var)``; the running
        statistics as ATen's CPU kernel updates them (float and double where it uses each; a
        float64 input all in double)."""
        x_node, weight, bias, rm, rv, _training, momentum, eps = node.args[:8]
        bb = self.block_builder
        x = self.env[x_node]
        dtype = self._train_dtype(x)
        mean, var_sum, invstd, count = self._batch_stats(x, float(eps))
        out = self._apply_affine(x, mean, invstd, weight, bias, centered=True)
        running_mean, running_var = self.env[rm], self.env[rv]
        if dtype == "float64":
            m, keep = float(momentum), 1.0 - float(momentum)
            new_mean = bb.emit(relax.op.add(self._product(m, mean), self._product(keep, running_mean)))
            unbiased = bb.emit(relax.op.divide(var_sum, self._c(max(count - 1, 1), dtype)))
            new_var = bb.emit(relax.op.add(self._product(m, unbiased), self._product(keep, running_var)))
            return bb.emit(relax.Tuple([out, mean, invstd, new_mean, new_var]))
        m = float(np.float32(momentum))
        keep = float(np.float32(1.0) - np.float32(momentum))
        new_mean = bb.emit(relax.op.add(self._product(m, mean), self._product(keep, running_mean)))
        unbiased = relax.op.astype(relax.op.divide(var_sum, self._c(max(count - 1, 1), dtype)), "float64")
        new_var = bb.emit(relax.op.astype(relax.op.add(
            relax.op.multiply(relax.const(m, "float64"), unbiased),
            relax.op.astype(relax.op.multiply(self._c(keep, dtype), running_var), "float64")), dtype))
        return bb.emit(relax.Tuple([out, mean, invstd, new_mean, new_var]))

    @staticmethod
    def _train_dtype(x: relax.Expr) -> str:
        dtype = str(x.ty.dtype)
        if dtype not in ("float32", "float64"):
            raise UnsupportedOpError("convert", f"batch_norm in train mode on {dtype}", op="batch_norm")
        return dtype

    def _batch_norm_no_stats(self, node: torch.fx.Node) -> relax.Expr:
        x_node, weight, bias, _training, _momentum, eps = node.args[:6]
        x = self.env[x_node]
        self._train_dtype(x)
        mean, _var_sum, invstd, _ = self._batch_stats(x, float(eps))
        out = self._apply_affine(x, mean, invstd, weight, bias, centered=True)
        return self.block_builder.emit(relax.Tuple([out, mean, invstd]))

    def _eval_norm(self, x_node: Any, weight: Any, bias: Any, rm: Any, rv: Any, eps: float) -> relax.Expr:
        """With the running statistics: ``invstd = 1 / sqrt(var + eps)`` in double, rounded to
        the statistics' dtype, as ATen computes it."""
        bb = self.block_builder
        running_var = self.env[rv]
        var = relax.op.add(relax.op.astype(running_var, "float64"), relax.const(eps, "float64"))
        invstd = relax.op.divide(relax.const(1.0, "float64"), relax.op.sqrt(var))
        invstd = bb.emit(relax.op.astype(invstd, str(running_var.ty.dtype)))
        return self._apply_affine(self.env[x_node], self.env[rm], invstd, weight, bias)

    def _batch_norm_eval(self, node: torch.fx.Node) -> relax.Expr:
        x_node, weight, bias, rm, rv, _momentum, eps = node.args[:7]
        out = self._eval_norm(x_node, weight, bias, rm, rv, float(eps))
        return self.block_builder.emit(relax.Tuple([out, out, out]))

    def _batch_norm_aten(self, node: torch.fx.Node) -> relax.Expr:
        x_node, weight, bias, rm, rv, training, _momentum, eps = node.args[:8]
        if training or rm is None:
            raise UnsupportedOpError("convert", "batch_norm in training mode outside the functional form", op="batch_norm")
        return self._eval_norm(x_node, weight, bias, rm, rv, float(eps))
