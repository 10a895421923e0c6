"""A dynamo graph split around what TVM cannot run, so the rest still compiles.

A custom ``autograd.Function`` (dynamo captures it as ``autograd_function_apply`` with its own
backward) must run in PyTorch; without a split the whole graph would. ``CapabilityBasedPartitioner``
groups the other nodes into pieces (``fused_0``, ...) that are compiled like whole graphs; the
split graph runs as Python, calling each piece and, between them, PyTorch's op. Nodes that change
global state (grad mode, autocast) stay in the split graph too, so each piece runs under the
state its ops were captured under.
"""
from __future__ import annotations

import operator

import torch
from torch._ops import HigherOrderOperator
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from .graph import INLINED

_STATEFUL = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast")


def runs_in_pytorch(node: torch.fx.Node) -> bool:
    """A higher-order op the bridge does not inline (a custom Function with its own backward)."""
    return (node.op == "call_function" and isinstance(node.target, HigherOrderOperator)
            and getattr(node.target, "__name__", "") not in INLINED)


def _tensors(value: object) -> bool:
    if isinstance(value, (tuple, list)):
        return bool(value) and all(isinstance(v, torch.Tensor) for v in value)
    return isinstance(value, torch.Tensor)


def _stays(node: torch.fx.Node) -> bool:
    if runs_in_pytorch(node) or getattr(node.target, "__name__", "") in _STATEFUL:
        return True
    if not _tensors(node.meta.get("example_value")):
        return True  # sizes and Python values: a piece hands out tensors only
    # the results of an op PyTorch runs are taken apart where it runs
    return node.op == "call_function" and node.target is operator.getitem and runs_in_pytorch(node.args[0])


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules: dict, node: torch.fx.Node) -> bool:
        # inputs, attributes (the op's bodies) and the output stay in the split graph
        return node.op in ("call_function", "call_method", "call_module") and not _stays(node)


def needs_split(gm: torch.fx.GraphModule) -> bool:
    return any(runs_in_pytorch(n) for n in gm.graph.nodes)


def split(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """``gm`` with its compilable parts as submodules: the split graph, the pieces' names, and
    what PyTorch runs between them (for ``explain``)."""
    partitioner = CapabilityBasedPartitioner(gm, _Support(), allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    fused = partitioner.fuse_partitions(partitions, prefix="tvm_piece_")
    pieces = [n.target for n in fused.graph.nodes if n.op == "call_module" and n.target.startswith("tvm_piece_")]
    kept = [str(getattr(n.target, "__name__", n.target)) for n in fused.graph.nodes if runs_in_pytorch(n)]
    return fused, pieces, kept
