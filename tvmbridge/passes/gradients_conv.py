"""Gradients of the convolution, normalization and pooling ops Relax 0.27 lacks or gets wrong
(dilation, groups, ties in a pooling window, overlapping adaptive bins).

Registered on import (``passes.gradient`` imports this module) through ``gradients.gradient``, at
the bridge's level, above Relax's, as ``gradients_nn``. Every formula is PyTorch's (ATen's)
autograd formula; a case a formula does not cover raises, which the gradient stage reports as an
``UnsupportedOpError`` naming the op: never an approximate number.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.ir import Attrs, Call
from tvm.relax import BlockBuilder, Expr, Var
from tvm.sym.analyzer import Analyzer

from .gradient_exprs import batch_and_static_dims, const, dtype_of, emit, sizes_of, static_dims
from .gradients import gradient

op = relax.op


# --- convolutions: 2-D and 3-D (1-D ones as 2-D with a unit height) -------------------------------
def batch_dims(expr: Expr, what: str) -> list[Any]:
    """An activation's sizes, each an int where static, else symbolic (a variant serving every
    batch size or length); the channels must be static."""
    dims = sizes_of(expr, what)
    if len(dims) < 2 or not isinstance(dims[1], int):
        raise NotImplementedError(f"the gradient of {what} needs static channels; got {expr.ty}")
    return dims


def _output_padding(extent: Any, what: str) -> int:
    """The transposed convolution's output padding, which must be a number: where the sizes are
    symbolic it simplifies to one for a stride of 1, not for larger strides (it is then the
    length modulo the stride)."""
    value = Analyzer().simplify(extent) if not isinstance(extent, int) else extent
    if isinstance(value, tvm.tirx.IntImm):
        return int(value)
    if isinstance(value, int):
        return value
    raise NotImplementedError(f"the gradient of {what} with a stride over a symbolic size (output padding {value})")


def conv_data_grad(
    g: Expr, w: Expr, x_dims: list[Any], strides: list[int], padding: list[int], dilation: list[int], groups: int
) -> Expr:
    """The input gradient of a 2-D or 3-D convolution (NC..., OI...): the transposed convolution
    of the output gradient, with the output padding that gives back the input's size (Relax's own
    ``conv2d`` gradient leaves dilation out of that size)."""
    spatial = len(x_dims) - 2
    g_dims, k_dims = batch_dims(g, "relax.nn.conv"), static_dims(w, "relax.nn.conv")
    extra = []
    for i in range(spatial):
        covered = (g_dims[2 + i] - 1) * strides[i] - padding[i] - padding[i + spatial]
        extra.append(_output_padding(x_dims[2 + i] - covered - dilation[i] * (k_dims[2 + i] - 1) - 1, "relax.nn.conv"))
    transpose, layout = (op.nn.conv2d_transpose, "IOHW") if spatial == 2 else (op.nn.conv3d_transpose, "IODHW")
    return transpose(g, w, strides, padding, extra, dilation, groups, kernel_layout=layout, out_dtype=dtype_of(g))


def conv_weight_grad(
    x: Expr, g: Expr, k_dims: list[int], strides: list[int], padding: list[int], dilation: list[int], groups: int
) -> Expr:
    """The weight gradient of a 2-D or 3-D convolution (NC..., OI...): a convolution of the input,
    batch and channels swapped (per group), with the output gradient as kernel; stride and
    dilation trade places, and the result is cut to the kernel's size."""
    dims = batch_dims(x, "relax.nn.conv")
    n, c, space = dims[0], dims[1], dims[2:]
    axes = list(range(2, 2 + len(space)))
    per_group = c // groups
    data = op.reshape(x, (n, groups, per_group, *space))
    data = op.reshape(op.permute_dims(data, [2, 1, 0, *(a + 1 for a in axes)]), (per_group, groups * n, *space))
    kernel = op.permute_dims(g, [1, 0, *axes])
    conv = op.nn.conv2d if len(space) == 2 else op.nn.conv3d
    out = conv(data, kernel, dilation, padding, strides, groups, out_dtype=dtype_of(x))
    out = op.strided_slice(out, axes, [0] * len(axes), k_dims[2:])
    return op.permute_dims(out, [1, 0, *axes])


def conv2d_attrs(attrs: Attrs) -> tuple[list[int], list[int], list[int], int]:
    """Strides, padding (top, left, bottom, right), dilation, groups of an NCHW/OIHW conv."""
    if (str(attrs.data_layout), str(attrs.out_layout)) != ("NCHW", "NCHW") or str(attrs.kernel_layout) not in (
        "OIHW",
        "IOHW",
    ):
        raise NotImplementedError(
            f"the gradient of a relax.nn convolution in layout {attrs.data_layout}/{attrs.kernel_layout}"
        )
    pad = [int(p) for p in attrs.padding]
    pad = pad * 2 if len(pad) == 2 else pad
    return [int(s) for s in attrs.strides], pad, [int(d) for d in attrs.dilation], int(attrs.groups)


@gradient("relax.nn.conv2d")
def conv2d_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Input and weight gradients, dilation and groups included."""
    x, w = orig_call.args
    strides, padding, dilation, groups = conv2d_attrs(orig_call.attrs)
    if str(orig_call.attrs.kernel_layout) != "OIHW":
        raise NotImplementedError(f"the gradient of relax.nn.conv2d with kernel layout {orig_call.attrs.kernel_layout}")
    if all(d == 1 for d in dilation):
        # Relax's own gradient, which also handles symbolic batches; it fails only with dilation.
        # (The bridge's below gave NaN weight gradients on ResNet's 7x7/stride-2 stem, where the
        # stride does not divide the padded extent; left to dilated convolutions.)
        from tvm.relax.op._op_gradient import conv2d_grad as relax_conv2d_grad

        return relax_conv2d_grad(orig_var, orig_call, output_grad, ctx)
    dx = conv_data_grad(output_grad, w, batch_dims(x, "relax.nn.conv2d"), strides, padding, dilation, groups)
    dw = conv_weight_grad(x, output_grad, static_dims(w, "relax.nn.conv2d"), strides, padding, dilation, groups)
    return [dx, dw]


@gradient("relax.nn.conv2d_transpose")
def conv2d_transpose_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """A transposed convolution is the adjoint of the convolution with the same weight (IOHW
    read as OIHW): its input gradient is that convolution of the output gradient, its weight
    gradient that convolution's weight gradient with input and output gradient swapped."""
    x, w = orig_call.args
    strides, padding, dilation, groups = conv2d_attrs(orig_call.attrs)
    if str(orig_call.attrs.kernel_layout) != "IOHW":
        raise NotImplementedError(
            f"the gradient of relax.nn.conv2d_transpose with kernel layout {orig_call.attrs.kernel_layout}"
        )
    dx = op.nn.conv2d(output_grad, w, strides, padding, dilation, groups, out_dtype=dtype_of(x))
    dw = conv_weight_grad(
        output_grad, x, static_dims(w, "relax.nn.conv2d_transpose"), strides, padding, dilation, groups
    )
    return [dx, dw]


@gradient("relax.nn.conv3d")
def conv3d_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Input and weight gradients of a 3-D convolution (video models, LambdaNets' position
    lambdas), dilation and groups included; Relax has none."""
    attrs = orig_call.attrs
    if (str(attrs.data_layout), str(attrs.out_layout), str(attrs.kernel_layout)) != ("NCDHW", "NCDHW", "OIDHW"):
        raise NotImplementedError(
            f"the gradient of relax.nn.conv3d in layout {attrs.data_layout}/{attrs.kernel_layout}"
        )
    x, w = orig_call.args
    pad = [int(p) for p in attrs.padding]
    padding = pad * 2 if len(pad) == 3 else pad
    strides, dilation, groups = [int(v) for v in attrs.strides], [int(v) for v in attrs.dilation], int(attrs.groups)
    dx = conv_data_grad(output_grad, w, batch_dims(x, "relax.nn.conv3d"), strides, padding, dilation, groups)
    dw = conv_weight_grad(x, output_grad, static_dims(w, "relax.nn.conv3d"), strides, padding, dilation, groups)
    return [dx, dw]


def conv1d_attrs(attrs: Attrs) -> tuple[list[int], list[int], list[int], int]:
    """A 1-D convolution's attributes as those of the 2-D one over a unit height."""
    if str(attrs.data_layout) != "NCW" or str(attrs.out_layout) != "NCW":
        raise NotImplementedError(f"the gradient of a relax.nn 1-D convolution in layout {attrs.data_layout}")
    pads = [int(p) for p in attrs.padding]
    left, right = (pads * 2)[:2]
    return [1, int(attrs.strides[0])], [0, left, 0, right], [1, int(attrs.dilation[0])], int(attrs.groups)


def conv1d_as_2d(orig_call: Call, output_grad: Var, ctx: BlockBuilder, kernel_layout: str) -> tuple:
    """A 1-D convolution's 2-D attributes (:func:`conv1d_attrs`) and its input, weight and output
    gradient with a unit height inserted, for the 2-D gradients."""
    if str(orig_call.attrs.kernel_layout) != kernel_layout:
        raise NotImplementedError(
            f"the gradient of {orig_call.op.name} with kernel layout {orig_call.attrs.kernel_layout}"
        )
    x, w = orig_call.args
    return (*conv1d_attrs(orig_call.attrs), tuple(emit(ctx, op.expand_dims(t, 2)) for t in (x, w, output_grad)))


@gradient("relax.nn.conv1d")
def conv1d_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """The 2-D gradients over a unit height."""
    strides, padding, dilation, groups, (x4, w4, g4) = conv1d_as_2d(orig_call, output_grad, ctx, "OIW")
    dx = conv_data_grad(g4, w4, batch_dims(x4, "relax.nn.conv1d"), strides, padding, dilation, groups)
    dw = conv_weight_grad(x4, g4, static_dims(w4, "relax.nn.conv1d"), strides, padding, dilation, groups)
    return [op.squeeze(dx, [2]), op.squeeze(dw, [2])]


@gradient("relax.nn.conv1d_transpose")
def conv1d_transpose_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """The 2-D transposed convolution's gradients over a unit height."""
    strides, padding, dilation, groups, (x4, w4, g4) = conv1d_as_2d(orig_call, output_grad, ctx, "IOW")
    dx = op.nn.conv2d(g4, w4, strides, padding, dilation, groups, out_dtype=dtype_of(orig_call.args[0]))
    dw = conv_weight_grad(g4, x4, static_dims(w4, "relax.nn.conv1d_transpose"), strides, padding, dilation, groups)
    return [op.squeeze(dx, [2]), op.squeeze(dw, [2])]


# --- normalization and pooling ------------------------------------------------------------------
@gradient("relax.nn.group_norm")
def group_norm_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``y = xhat * gamma + beta`` with ``xhat = (x - mean) * rstd`` per (sample, group):
    ``dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))``, ``dxhat = g * gamma``;
    ``dgamma = sum(g * xhat)``, ``dbeta = sum(g)`` over batch and space."""
    x, gamma, _beta = orig_call.args
    attrs = orig_call.attrs
    n, rest = batch_and_static_dims(x, "relax.nn.group_norm")  # the batch may be symbolic
    dims = [n, *rest]
    if int(attrs.channel_axis) != 1 or [int(a) for a in attrs.axes] != list(range(2, len(dims))):
        raise NotImplementedError("the gradient of relax.nn.group_norm over other axes than (N, C, *spatial)")
    c, groups = rest[0], int(attrs.num_groups)
    grouped = (n, groups, math.prod(rest) // groups)
    xr = op.reshape(x, grouped)
    centered = op.subtract(xr, op.mean(xr, 2, keepdims=True))
    var = op.mean(op.multiply(centered, centered), 2, keepdims=True)
    rstd = op.rsqrt(op.add(var, const(float(attrs.epsilon), x)))
    xhat = emit(ctx, op.multiply(centered, rstd))
    channel = [1, c] + [1] * (len(dims) - 2)
    dxhat = op.reshape(op.multiply(output_grad, op.reshape(gamma, channel)), grouped)
    inner = op.subtract(
        op.subtract(dxhat, op.mean(dxhat, 2, keepdims=True)),
        op.multiply(xhat, op.mean(op.multiply(dxhat, xhat), 2, keepdims=True)),
    )
    dx = op.reshape(op.multiply(rstd, inner), x.ty.shape)
    reduce = [0] + list(range(2, len(dims)))
    dgamma = op.sum(op.multiply(output_grad, op.reshape(xhat, x.ty.shape)), reduce)
    return [dx, dgamma, op.sum(output_grad, reduce)]


def window_argmax(xp: Expr, out_hw: list[int], attrs: Attrs, ctx: BlockBuilder) -> Expr:
    """Per output element, which kernel offset (row-major) holds its max, the first of equal
    ones (ATen's ``val > maxval``): ``argmax`` over the stacked strided windows."""
    (kh, kw), (sh, sw), (dh, dw) = ([int(v) for v in a] for a in (attrs.pool_size, attrs.strides, attrs.dilation))
    views = []
    for i in range(kh):
        for j in range(kw):
            begin = [i * dh, j * dw]
            end = [begin[0] + (out_hw[0] - 1) * sh + 1, begin[1] + (out_hw[1] - 1) * sw + 1]
            views.append(op.strided_slice(xp, [2, 3], begin, end, [sh, sw]))
    return emit(ctx, op.astype(op.argmax(op.stack(views, axis=2), axis=2), "int32"))


@gradient("relax.nn.max_pool2d")
def max_pool2d_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """The gradient goes to the max of each window, as ATen (Relax's own ``max_pool2d_backward``
    is wrong for some strides and paddings and does not build with dilation): each window's
    argmax offset in the -inf-padded input (ceil_mode's partial windows included), its position
    in the padded plane, every output's gradient added there in output order (ATen's order where
    windows overlap) by one scatter, the padding cut off."""
    attrs, x = orig_call.attrs, orig_call.args[0]
    if str(attrs.layout) != "NCHW" or str(attrs.out_layout) != "NCHW":
        raise NotImplementedError(f"the gradient of relax.nn.max_pool2d in layout {attrs.layout}")
    n, (c, h, w) = batch_and_static_dims(x, "relax.nn.max_pool2d")
    out_hw = batch_and_static_dims(orig_var, "relax.nn.max_pool2d")[1][1:]
    (kh, kw), (sh, sw), (dh, dw) = ([int(v) for v in a] for a in (attrs.pool_size, attrs.strides, attrs.dilation))
    pt, pl, pb, pr = [int(p) for p in attrs.padding]
    reach = [(out_hw[0] - 1) * sh + dh * (kh - 1) + 1, (out_hw[1] - 1) * sw + dw * (kw - 1) + 1]
    size = [pt + max(h + pb, reach[0] - pt), pl + max(w + pr, reach[1] - pl)]
    xp = emit(ctx, op.nn.pad(x, [0, 0, 0, 0, pt, size[0] - h - pt, pl, size[1] - w - pl], "constant", -math.inf))
    best_k = window_argmax(xp, out_hw, attrs, ctx)
    offsets = np.array([(k // kw) * dh * size[1] + (k % kw) * dw for k in range(kh * kw)], dtype="int64")
    rows, cols = np.meshgrid(np.arange(out_hw[0]) * sh, np.arange(out_hw[1]) * sw, indexing="ij")
    corners = (rows * size[1] + cols).astype("int64").reshape(1, 1, -1)
    flat = (n, c, out_hw[0] * out_hw[1])
    where = op.add(op.take(relax.const(offsets, "int64"), op.reshape(best_k, flat)), relax.const(corners, "int64"))
    plane = added_at(op.reshape(output_grad, flat), where, (n, c, *size), dtype_of(x))
    return [op.strided_slice(plane, [2, 3], [pt, pl], [pt + h, pl + w])]


def added_at(values: Expr, where: Expr, shape: tuple[Any, ...], dtype: str) -> Expr:
    """An (N, C, *plane) zero tensor with ``values`` (N, C, M) added at the flat plane positions
    ``where`` (N, C, M), one after another (the order ATen's pooling backward adds in)."""
    canvas = op.zeros((shape[0], shape[1], math.prod(shape[2:])), dtype)
    return op.reshape(op.scatter_elements(canvas, where, values, axis=2, reduction="add"), shape)


def avg_pool_windows(in_hw: list[int], out_hw: list[int], attrs: Attrs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ATen's average-pooling windows: per output its divisor (the window clipped to the padded
    input, or to the input itself without ``count_include_pad``), and every (output, input
    position) pair of the windows clipped to the input, in ATen's loop order."""
    (kh, kw), (sh, sw) = ([int(v) for v in a] for a in (attrs.pool_size, attrs.strides))
    pt, pl, pb, pr = [int(p) for p in attrs.padding]
    if (pt, pl) != (pb, pr) or any(int(d) != 1 for d in attrs.dilation):
        raise NotImplementedError("the gradient of relax.nn.avg_pool2d with uneven padding or dilation")
    (h, w), divisors, outputs, positions = in_hw, np.zeros(out_hw), [], []
    for i, j in np.ndindex(*out_hw):
        h0, w0 = i * sh - pt, j * sw - pl
        h1, w1 = min(h0 + kh, h + pt), min(w0 + kw, w + pl)
        pool = (h1 - h0) * (w1 - w0)
        h0, w0, h1, w1 = max(h0, 0), max(w0, 0), min(h1, h), min(w1, w)
        divisors[i, j] = pool if attrs.count_include_pad else (h1 - h0) * (w1 - w0)
        for r, q in np.ndindex(h1 - h0, w1 - w0):
            outputs.append(i * out_hw[1] + j)
            positions.append((h0 + r) * w + w0 + q)
    return divisors, np.array(outputs, dtype="int64"), np.array(positions, dtype="int64")


@gradient("relax.nn.avg_pool2d")
def avg_pool2d_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """With ceil_mode, each output's gradient divided by its window's divisor and added to every
    input element of its window, in output order, as ATen: Relax's own is wrong where a
    ceil_mode window overhangs the padding with ``count_include_pad``. Without ceil_mode Relax's
    own (right there, and it keeps no (N, C, outputs x window) index tensor)."""
    attrs, x = orig_call.attrs, orig_call.args[0]
    if not attrs.ceil_mode:
        from tvm.relax.op._op_gradient import avg_pool2d_grad as relax_avg_pool2d_grad

        return relax_avg_pool2d_grad(orig_var, orig_call, output_grad, ctx)
    if str(attrs.layout) != "NCHW" or str(attrs.out_layout) != "NCHW":
        raise NotImplementedError(f"the gradient of relax.nn.avg_pool2d in layout {attrs.layout}")
    n, (c, h, w) = batch_and_static_dims(x, "relax.nn.avg_pool2d")
    out_hw = batch_and_static_dims(orig_var, "relax.nn.avg_pool2d")[1][1:]
    divisors, outputs, positions = avg_pool_windows([h, w], out_hw, attrs)
    if positions.size == 0:
        return [op.zeros_like(x)]
    share = op.divide(output_grad, relax.const(divisors, dtype_of(x)))
    values = op.take(op.reshape(share, (n, c, out_hw[0] * out_hw[1])), relax.const(outputs, "int64"), axis=2)
    where = op.broadcast_to(relax.const(positions, "int64"), (n, c, positions.size))
    return [added_at(values, where, (n, c, h, w), dtype_of(x))]


def adaptive_bins(size: int, out: int, dtype: str) -> np.ndarray:
    """``(out, size)``: row ``i`` averages ``[floor(i*size/out), ceil((i+1)*size/out))``, as
    PyTorch's adaptive pooling (and TOPI's) bins the input."""
    m = np.zeros((out, size), dtype=dtype)
    for i in range(out):
        start, end = (i * size) // out, -((-(i + 1) * size) // out)
        m[i, start:end] = 1.0 / (end - start)
    return m


def adaptive_pool_grad(output_grad: Expr, x: Expr, layout: str, what: str) -> Expr:
    """The adjoint of the averaging over bins, axis by axis: ``A_h^T g A_w`` (a matmul with
    each axis' bin matrix)."""
    if layout not in ("NCW", "NCHW"):
        raise NotImplementedError(f"the gradient of {what} in layout {layout}")
    # the bins are per spatial axis: those sizes static, the batch may be symbolic
    dims, out_dims = batch_dims(x, what), batch_dims(output_grad, what)
    if not all(isinstance(d, int) for d in dims[2:] + out_dims[2:]):
        raise NotImplementedError(f"the gradient of {what} needs static spatial sizes; got {x.ty}")
    grad = output_grad
    if len(dims) == 4:
        rows = adaptive_bins(dims[2], out_dims[2], dtype_of(x))
        grad = op.matmul(relax.const(rows.T.copy(), dtype_of(x)), grad, out_dtype=dtype_of(x))
    cols = adaptive_bins(dims[-1], out_dims[-1], dtype_of(x))
    return op.matmul(grad, relax.const(cols, dtype_of(x)), out_dtype=dtype_of(x))


@gradient("relax.nn.adaptive_avg_pool2d")
@gradient("relax.nn.adaptive_avg_pool1d")
def adaptive_avg_pool_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Each input element gets ``g / bin size`` of every bin it lies in (bins may overlap); the
    1-D pool as the 2-D one, over one axis."""
    name, layout = orig_call.op.name, str(orig_call.attrs.layout)
    if str(orig_call.attrs.out_layout) != layout:
        raise NotImplementedError(f"the gradient of {name} with another output layout")
    return [adaptive_pool_grad(output_grad, orig_call.args[0], layout, name)]
