"""Keep the memory layout the trace recorded for the ops the bridge decomposes its own way.

A traced program can depend on a result's strides without saying so: ``out.permute(0, 2, 1,
3).contiguous().view(b, n, -1)`` records no copy for ``contiguous()`` when the traced kernel's
output was already laid out that way, and the ``view`` is valid only over that layout.
``scaled_dot_product_attention`` on CPU traces through the flash kernel, whose output is
(batch, length, heads, dim) in memory; the bridge writes attention out as ATen's math kernel
(``decompositions.sdpa_math``), whose output is contiguous (batch, heads, length, dim), and the
``view`` after it fails. So before decomposing, each such op's result is re-laid out to the
strides the trace recorded: permute to the recorded order, copy, permute back. The values are
untouched, and after conversion the three ops fuse with whatever reads them.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import optimization_hint

from .decompositions import LAYOUT_CHANGING

_RELAID = "tvmbridge_relaid"  # a program decomposed twice (a retrace) is re-laid out once


def keep_traced_layouts(ep: ExportedProgram) -> int:
    """Re-lay the results of the ops in ``LAYOUT_CHANGING`` whose traced strides are not
    contiguous; returns how many were."""
    count = 0
    for module in ep.graph_module.modules():  # bodies of autocast and no_grad regions too
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in list(module.graph.nodes):
            if node.op != "call_function" or node.target not in LAYOUT_CHANGING or node.meta.get(_RELAID):
                continue
            order = stride_order(node.meta.get("val"))
            if order is None:
                continue
            _relay(module.graph, node, order)
            changed = True
            count += 1
        if changed:
            module.recompile()
    return count


def stride_order(val: object) -> list[int] | None:
    """The dimensions of ``val`` from outermost to innermost in memory, or None where ``val`` is
    not a tensor or is laid out in order already. Symbolic strides are read by their hints, which
    adds no guard (``int()`` of one would specialize the variant's symbolic sizes)."""
    if not isinstance(val, torch.Tensor):
        return None
    strides = [optimization_hint(s, fallback=0) for s in val.stride()]
    order = sorted(range(len(strides)), key=lambda d: -strides[d])  # stable: size-1 dims keep their place
    return None if order == list(range(len(strides))) else order


def _relay(graph: torch.fx.Graph, node: torch.fx.Node, order: list[int]) -> None:
    """``node``'s users read ``permute(clone(permute(node, order)), inverse(order))`` instead."""
    inverse = [order.index(d) for d in range(len(order))]
    aten = torch.ops.aten
    val = node.meta["val"]
    users = list(node.users)
    with graph.inserting_after(node):
        outer = graph.call_function(aten.permute.default, (node, order))
    with graph.inserting_after(outer):
        copy = graph.call_function(aten.clone.default, (outer,), {"memory_format": torch.contiguous_format})
    with graph.inserting_after(copy):
        back = graph.call_function(aten.permute.default, (copy, inverse))
    outer.meta["val"] = val.permute(order)
    copy.meta["val"] = outer.meta["val"].clone(memory_format=torch.contiguous_format)
    back.meta["val"] = copy.meta["val"].permute(inverse)
    for name in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node"):
        if name in node.meta:
            for new in (outer, copy, back):
                new.meta[name] = node.meta[name]
    for user in users:
        user.replace_input_with(node, back)
    node.meta[_RELAID] = True
