"""Convolutions from the library PyTorch ships (oneDNN on x86 CPUs), as TVM packed functions on
zero-copy DLPack views.

TVM's own convolution kernels on a CPU, untuned, are loops the bridge's generic schedules only
parallelize: a CNN's training step ran 4-30x slower than eager. A convolution (forward, and the
two that make its gradients: the transposed one for the input, and one over the input for the
weight) is called here instead, as ``kernels/gemm.py`` calls GEMMs. The attributes travel as a
shape argument, so four functions serve every convolution: the forward one, the transposed one,
the weight gradient as ATen computes it, and both gradients of one convolution in one call
(``backend/conv_pairs.py`` pairs them where a step needs both).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import tvm_ffi

from .. import names
from .gemm import to_tvm_compact

CONV2D = f"{names.PACKED_PREFIX}conv2d"
CONV2D_TRANSPOSE = f"{names.PACKED_PREFIX}conv2d_transpose"
CONV2D_WEIGHT_GRAD = f"{names.PACKED_PREFIX}conv2d_weight_grad"
CONV2D_BACKWARD = f"{names.PACKED_PREFIX}conv2d_backward"
# float64 too: the double-precision checks then run the same calls as float32 training does
DTYPES = ("float32", "bfloat16", "float16", "float64")  # the result's dtype travels as its index here

# the attribute vector both functions take (conv2d: padding top, left, bottom, right; the
# transposed one: padding symmetric, then its output padding), then which tensors are stored in
# the other order of their first two dims (CNHW data and result, IOHW kernel: how Relax writes a
# weight gradient, which ``conv2d_weight_grad`` takes with any groups, ``conv2d`` with one), then
# the result's dtype (an index in DTYPES)
ATTRS = (
    "stride_h",
    "stride_w",
    "pad_a",
    "pad_b",
    "pad_c",
    "pad_d",
    "dilation_h",
    "dilation_w",
    "groups",
    "data_cn",
    "kernel_io",
    "out_cn",
    "out_dtype",
)
_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """An operand in float32: every convolution computes in float32 and rounds its result once, as
    the bridge's ``Float32Opmath`` has every other low-precision op do (under autocast that pass
    hands the convolution float32 operands already)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _result(y: torch.Tensor, out: int) -> Any:
    """The result in the graph's dtype (``DTYPES[out]``), compact, for TVM: one copy where the dtype
    or the layout differs, none where neither does (``Tensor.to`` with a memory format copies
    even then, ~10 us a call)."""
    dtype = _TORCH_DTYPES[out]
    if y.dtype != dtype:
        y = y.to(dtype, memory_format=torch.contiguous_format)
    return to_tvm_compact(y)


def _swapped(t: torch.Tensor, swap: int) -> torch.Tensor:
    return t.permute(1, 0, 2, 3) if swap else t  # a view: PyTorch reads either layout


def conv2d(x: Any, w: Any, attrs: Any) -> Any:
    """``relax.nn.conv2d`` on PyTorch's convolution (the layouts by ``ATTRS``' flags, as views);
    asymmetric padding is a pad first. Autocast off: the graph fixed the dtype."""
    sh, sw, top, left, bottom, right, dh, dw, groups, data_cn, kernel_io, out_cn, out = (int(a) for a in attrs)
    tx, tw = _swapped(torch.from_dlpack(x), data_cn), _swapped(torch.from_dlpack(w), kernel_io)
    tx, tw = _opmath(tx), _opmath(tw)
    with torch._C._DisableAutocast():
        if (top, left) != (bottom, right):
            tx = torch.nn.functional.pad(tx, (left, right, top, bottom))
            top = left = 0
        y = torch.nn.functional.conv2d(tx, tw, None, (sh, sw), (top, left), (dh, dw), groups)
    return _result(_swapped(y, out_cn), out)


def conv2d_transpose(x: Any, w: Any, attrs: Any) -> Any:
    """``relax.nn.conv2d_transpose`` (NCHW, IOHW, symmetric padding) on PyTorch's."""
    sh, sw, ph, pw, oph, opw, dh, dw, groups, _, _, _, out = (int(a) for a in attrs)
    tx, tw = torch.from_dlpack(x), torch.from_dlpack(w)
    with torch._C._DisableAutocast():
        y = torch.nn.functional.conv_transpose2d(
            _opmath(tx), _opmath(tw), None, (sh, sw), (ph, pw), (oph, opw), groups, (dh, dw)
        )
    return _result(y, out)


def weight_grad_extent(size: int, pads: int, stride: int, dilation: int, grad_size: int) -> int | None:
    """The kernel extent of the forward convolution whose weight gradient is a CNHW/IOHW
    convolution (``stride`` and ``dilation`` of that convolution, which are the forward's
    dilation and stride) over ``size`` input and ``grad_size`` output-gradient positions: the
    extent that convolution computes, provided a forward convolution of it gives ``grad_size``
    outputs again (always true of one a gradient wrote), else None."""
    extent = (size + pads - dilation * (grad_size - 1) - 1) // stride + 1
    forward_out = (size + pads - stride * (extent - 1) - 1) // dilation + 1
    return extent if extent >= 1 and forward_out == grad_size else None


def conv2d_weight_grad(data: Any, g: Any, attrs: Any) -> Any:
    """A CNHW-data, IOHW-kernel, CNHW-result ``relax.nn.conv2d`` (how Relax writes the weight
    gradient of a convolution) as that weight gradient: ATen's ``convolution_backward`` for the
    weight alone, the kernel eager runs (a forward convolution of the same sums, with the whole
    output gradient as its kernel, is many times slower, most of all a depthwise one). The
    forward input is the data read back from Relax's per-group order (batch and group swapped);
    the result extent is the convolution's, of which the gradient keeps the forward kernel's."""
    sh, sw, top, left, bottom, right, dh, dw, groups, _, _, _, out = (int(a) for a in attrs)
    d, tg = torch.from_dlpack(data), torch.from_dlpack(g)
    n, per_group, (height, width) = tg.shape[0], d.shape[1], d.shape[2:]
    x = d.reshape(groups, n, per_group, height, width).transpose(0, 1).reshape(n, groups * per_group, height, width)
    x, tg = _opmath(x), _opmath(tg)
    kh = weight_grad_extent(height, top + bottom, sh, dh, tg.shape[2])
    kw = weight_grad_extent(width, left + right, sw, dw, tg.shape[3])
    if kh is None or kw is None:
        raise ValueError(f"conv2d_weight_grad: {tuple(d.shape)}, {tuple(tg.shape)}: no weight gradient's operands")
    with torch._C._DisableAutocast():
        if (top, left) != (bottom, right):
            x = torch.nn.functional.pad(x, (left, right, top, bottom))
            top = left = 0
        weight = torch.empty((), dtype=x.dtype).expand(tg.shape[1], per_group, kh, kw)
        y = torch.ops.aten.convolution_backward(
            tg, x, weight, None, (dh, dw), (top, left), (sh, sw), False, (0, 0), groups, (False, True, False)
        )[1]
    return _result(y, out)


# conv2d_backward's attribute vector: the forward convolution's geometry (symmetric padding), then
# the dtypes (indices in DTYPES) of the input gradient and of the weight gradient
BACKWARD_ATTRS = (
    "stride_h",
    "stride_w",
    "pad_h",
    "pad_w",
    "dilation_h",
    "dilation_w",
    "groups",
    "dx_dtype",
    "dw_dtype",
)


def conv2d_backward(g: Any, x: Any, w: Any, attrs: Any) -> tuple[Any, Any]:
    """Both gradients of an NCHW/OIHW convolution from the output gradient ``g``, its input ``x``
    and weight ``w`` in one call of ATen's ``convolution_backward``, as eager's autograd makes it
    (one oneDNN backward: the transposed convolution and the weight gradient share its setup, and
    the input is read as it is, not regrouped)."""
    sh, sw, ph, pw, dh, dw, groups, out_x, out_w = (int(a) for a in attrs)
    tg, tx, tw = (_opmath(torch.from_dlpack(t)) for t in (g, x, w))
    with torch._C._DisableAutocast():
        dx, dweight, _ = torch.ops.aten.convolution_backward(
            tg, tx, tw, None, (sh, sw), (ph, pw), (dh, dw), False, (0, 0), groups, (True, True, False)
        )
    return _result(dx, out_x), _result(dweight, out_w)


@functools.cache
def register_convs() -> None:
    """Register the packed functions with TVM's FFI (once per process)."""
    tvm_ffi.register_global_func(CONV2D, conv2d, override=True)
    tvm_ffi.register_global_func(CONV2D_TRANSPOSE, conv2d_transpose, override=True)
    tvm_ffi.register_global_func(CONV2D_WEIGHT_GRAD, conv2d_weight_grad, override=True)
    tvm_ffi.register_global_func(CONV2D_BACKWARD, conv2d_backward, override=True)
