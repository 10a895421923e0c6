"""Offload 2-D convolutions to PyTorch's (oneDNN on x86 CPUs), through ``R.call_pure_packed``.

Every ``relax.nn.conv2d`` (NCHW, OIHW) and ``relax.nn.conv2d_transpose`` (NCHW, IOHW, symmetric
padding) in float32, bfloat16, float16 or float64 becomes a call of ``kernels/conv.py``'s packed
functions, the forward's convolution and the two its gradient is written with alike. The
CNHW/IOHW convolution Relax writes a weight gradient as (any groups) becomes ATen's weight
gradient, the kernel eager runs for it; where a step needs both gradients of one convolution,
one call computes them (``conv_pairs``). A convolution another
layout, dtype or attribute leaves to TVM stays TVM's. The pass decides nothing by timing: the
library's kernels beat TVM's untuned CPU convolutions on every shape the zoo has.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..ir import RewriteBindings, Rule, is_op
from ..kernels.conv import CONV2D, CONV2D_BACKWARD, CONV2D_TRANSPOSE, CONV2D_WEIGHT_GRAD, DTYPES, weight_grad_extent
from .conv_pairs import PairConvolutionGradients

_PACKED = (CONV2D, CONV2D_TRANSPOSE, CONV2D_WEIGHT_GRAD, CONV2D_BACKWARD)


def _ints(values: object) -> list[int]:
    return [int(v) for v in values]  # type: ignore[attr-defined]


def _layouts(value: relax.Call, kernel_layout: str) -> tuple[int, int, int] | None:
    """Which of data, kernel and result are stored with their first two dims swapped (NCHW or
    CNHW data and result; the given kernel layout or its I/O swap), where the operands share one
    float dtype and the result has one (under autocast ``low_precision`` leaves float32 operands
    and a bfloat16 result); else None."""
    attrs = value.attrs
    ty = getattr(value, "ty", None)
    dtypes = {str(a.ty.dtype) for a in value.args if isinstance(getattr(a, "ty", None), relax.TensorType)}
    if not (isinstance(ty, relax.TensorType) and ty.shape is not None and len(dtypes) == 1):
        return None
    if not (dtypes | {str(ty.dtype)}) <= set(DTYPES):
        return None
    swapped_kernel = kernel_layout[1] + kernel_layout[0] + kernel_layout[2:]
    flags = {"NCHW": 0, "CNHW": 1}
    data, out, kernel = str(attrs.data_layout), str(attrs.out_layout), str(attrs.kernel_layout)
    if data not in flags or out not in flags or kernel not in (kernel_layout, swapped_kernel):
        return None
    return flags[data], int(kernel == swapped_kernel), flags[out]


def _spatial(expr: relax.Expr) -> tuple[int, int] | None:
    """Height and width of an NCHW-like tensor when both are known integers (the batch may be
    symbolic)."""
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    try:
        return (int(shape[2]), int(shape[3])) if shape is not None and len(shape) == 4 else None
    except (TypeError, ValueError):
        return None


def _is_weight_grad(value: relax.Call) -> bool:
    """Whether a CNHW/IOHW/CNHW convolution is the weight gradient of a forward one (static
    spatial sizes for which ``kernels.conv.weight_grad_extent`` finds that forward's kernel)."""
    data, kernel = (_spatial(a) for a in value.args)
    if data is None or kernel is None:
        return False
    attrs = value.attrs
    (sh, sw), (dh, dw), pad = _ints(attrs.strides), _ints(attrs.dilation), _ints(attrs.padding)
    return (
        weight_grad_extent(data[0], pad[0] + pad[2], sh, dh, kernel[0]) is not None
        and weight_grad_extent(data[1], pad[1] + pad[3], sw, dw, kernel[1]) is not None
    )


def conv_attrs(value: relax.Call) -> tuple[str, list[int]] | None:
    """The packed function and attribute vector (``kernels.conv.ATTRS``) for a convolution the
    library can run, else None."""
    op = value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else ""
    if op not in ("relax.nn.conv2d", "relax.nn.conv2d_transpose"):
        return None  # most bindings: decided on the op's name alone
    attrs = value.attrs
    if op == "relax.nn.conv2d":
        layouts = _layouts(value, "OIHW")
        if layouts is None:
            return None
        geometry = [*_ints(attrs.strides), *_ints(attrs.padding), *_ints(attrs.dilation), int(attrs.groups)]
        vector = [*geometry, *layouts, DTYPES.index(str(value.ty.dtype))]
        if layouts == (1, 1, 1) and _is_weight_grad(value):
            return CONV2D_WEIGHT_GRAD, vector
        return (CONV2D, vector) if layouts == (0, 0, 0) or int(attrs.groups) == 1 else None
    if op == "relax.nn.conv2d_transpose":
        if _layouts(value, "IOHW") != (0, 0, 0):
            return None
        top, left, bottom, right = _ints(attrs.padding)
        strides, dilation, extra = _ints(attrs.strides), _ints(attrs.dilation), _ints(attrs.output_padding)
        # PyTorch's own rules: symmetric padding, output padding below stride or dilation
        if (top, left) != (bottom, right) or any(e >= max(s, d) for e, s, d in zip(extra, strides, dilation)):
            return None
        out = DTYPES.index(str(value.ty.dtype))
        return CONV2D_TRANSPOSE, [*strides, top, left, *extra, *dilation, int(attrs.groups), 0, 0, 0, out]
    return None


def _rule() -> Rule:
    def rule(value: relax.Expr, bound: dict) -> relax.Expr | None:
        if not isinstance(value, relax.Call):
            return None
        found = conv_attrs(value)
        if found is None:
            return None
        name, vector = found
        x, w = value.args
        return relax.op.call_pure_packed(name, x, w, relax.ShapeExpr(vector), ty_args=value.ty)

    return rule


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.OffloadConvolutions")
class OffloadConvolutions:
    """Every convolution :func:`conv_attrs` accepts becomes a call of the library's."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = relax.transform.Normalize()(mod)
        mod = RewriteBindings([_rule()])(mod)  # type: ignore[operator]  # module_pass: unseen by mypy
        return PairConvolutionGradients()(mod)  # type: ignore[operator]


def offloaded_convs(func: relax.Function) -> int:
    """How many convolutions ``func`` calls in the library."""
    return sum(
        1
        for block in func.body.blocks
        for b in block.bindings
        if is_op(b.value, "relax.call_pure_packed") and str(b.value.args[0].global_symbol) in _PACKED
    )
