"""Matmul-like ops and convolution in the input's dtype (the frontend fixes ``out_dtype="float32"``,
so a float64 model would be computed, and its convolutions not even converted, in float32)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tvm import relax

from ...errors import UnsupportedOpError
from .registry import args_of, converter, kwargs_of

if TYPE_CHECKING:
    from ..importer import BridgeImporter


@converter("matmul.default", "mm.default", "bmm.default")
def matmul(importer: BridgeImporter, node: torch.fx.Node) -> relax.Var:
    args = args_of(node)
    a, b = importer.env[args[0]], importer.env[args[1]]
    return importer.block_builder.emit(relax.op.matmul(a, b, out_dtype=str(a.ty.dtype)))


@converter("addmm.default")
def addmm_keep_dtype(importer: BridgeImporter, node: torch.fx.Node) -> relax.Var:
    args, kwargs = args_of(node), kwargs_of(node)
    bias, a, b = (importer.env[n] for n in args[:3])
    alpha = kwargs.get("alpha", 1)
    beta = kwargs.get("beta", 1)
    dtype = str(a.ty.dtype)
    bb = importer.block_builder
    res = bb.emit(relax.op.matmul(a, b, out_dtype=dtype))
    if alpha != 1:
        res = bb.emit(relax.op.multiply(res, relax.const(alpha, dtype)))
    if beta == 0:
        return res
    if beta != 1:
        bias = bb.emit(relax.op.multiply(bias, relax.const(beta, dtype)))
    return bb.emit(relax.op.add(res, bias))  # matmul first: the form CombineParallelMatmul matches


@converter("linear.default")
def linear_keep_dtype(importer: BridgeImporter, node: torch.fx.Node) -> relax.Var:
    args = importer.retrieve_args(node)
    bias = args[2] if len(args) > 2 else None
    return importer.block_builder.emit(relax.op.linear(args[0], args[1], bias, str(args[0].ty.dtype)))


@converter("convolution.default")
def convolution_keep_dtype(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``aten.convolution`` in the input's dtype (the frontend fixes float32, so a float64
    convolution does not even convert): 1-3-D, transposed 1-D and 2-D."""
    args = args_of(node)
    x, w = importer.env[args[0]], importer.env[args[1]]
    bias = args[2]
    stride, padding, dilation, transposed, out_pad, groups = args[3:9]
    ndim = len(x.ty.shape) - 2
    dtype = str(x.ty.dtype)
    layouts = {1: ("NCW", "W"), 2: ("NCHW", "HW"), 3: ("NCDHW", "DHW")}
    if ndim not in layouts or (transposed and ndim == 3):
        raise UnsupportedOpError(
            "convert", f"a {ndim}-D {'transposed ' if transposed else ''}convolution", op="convolution"
        )
    data_layout, space = layouts[ndim]
    common = dict(
        strides=list(stride),
        padding=list(padding),
        dilation=list(dilation),
        groups=int(groups),
        data_layout=data_layout,
        out_dtype=dtype,
    )
    if transposed:
        fn = {1: relax.op.nn.conv1d_transpose, 2: relax.op.nn.conv2d_transpose}[ndim]
        out = fn(x, w, output_padding=list(out_pad), kernel_layout="IO" + space, **common)
    else:
        fn = {1: relax.op.nn.conv1d, 2: relax.op.nn.conv2d, 3: relax.op.nn.conv3d}[ndim]
        out = fn(x, w, kernel_layout="OI" + space, **common)
    out = importer.block_builder.emit(out)
    if bias is None:
        return out
    b = relax.op.reshape(importer.env[bias], [1, -1] + [1] * ndim)
    return importer.block_builder.emit(relax.op.add(out, b))
