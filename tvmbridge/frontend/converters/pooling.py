"""Pooling with the arguments TVM's frontend would ignore refused or honoured, never converted wrong:
``avg_pool2d``'s ``divisor_override``, ``max_pool{2,3}d``'s indices."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tvm import relax

from ...errors import UnsupportedOpError
from .registry import args_of, converter, kwargs_of, op_name, uses_of_item

if TYPE_CHECKING:
    from ..importer import BridgeImporter


@converter("avg_pool2d.default", wraps_default=True)
def avg_pool2d_checked(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """``divisor_override`` (which the frontend ignores): without ceil_mode and with padding
    counted, every window has kh*kw elements, so the sum over ``d`` is the mean times kh*kw/d."""
    args, kwargs = args_of(node), kwargs_of(node)
    names_ = ("self", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
    given = {**dict(zip(names_, args)), **kwargs}
    divisor = given.get("divisor_override")
    out = default(node)
    if divisor is None:
        return out
    if given.get("ceil_mode", False) or not given.get("count_include_pad", True):
        raise UnsupportedOpError(
            "convert", "avg_pool2d with divisor_override and ceil_mode or count_include_pad=False", op="avg_pool2d"
        )
    kernel = given["kernel_size"]
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else (kernel[0], kernel[-1])
    scale = relax.const(kh * kw / float(divisor), str(out.ty.dtype))
    return importer.block_builder.emit(relax.op.multiply(out, scale))


@converter("max_pool2d_with_indices.default", "max_pool3d_with_indices.default", wraps_default=True)
def max_pool_values_only(importer: BridgeImporter, node: torch.fx.Node, default: Callable) -> relax.Expr:
    """The pooled values; a use of the indices output (``return_indices=True``) is refused."""
    if uses_of_item(node, 1):
        raise UnsupportedOpError(
            "convert",
            f"{op_name(node)}: the indices output (return_indices=True) is not supported; use fallback=True",
            op=op_name(node),
        )
    return default(node)
