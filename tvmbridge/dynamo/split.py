"""A dynamo graph split around what TVM cannot run, so the rest still compiles.

A custom ``autograd.Function`` (dynamo captures it as ``autograd_function_apply`` with its own
backward) must run in PyTorch; so must an op the bridge cannot convert (the nodes a
``ConversionError`` names as its ``sources``). Without a split the whole graph would. The graph
is cut in graph order at *barriers*: the ops PyTorch runs, the switches of global state (grad
mode, autocast) and in-place writes to the graph's inputs. Each run of nodes between two barriers becomes one piece
(``tvm_piece_0``, ...), compiled like a whole graph. Cutting in order (not grouping by data
edges, as a capability partitioner does) keeps every piece under the grad mode and autocast it
was captured under, keeps writes before and after the ops that read them, and keeps the random
ops' draws in eager's order.
"""

from __future__ import annotations

import operator

import torch
from torch._ops import HigherOrderOperator
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from .graph import INLINED

_STATEFUL = ("_set_grad_enabled", "_enter_autocast", "_exit_autocast")


def runs_in_pytorch(node: torch.fx.Node, named: frozenset[str] = frozenset()) -> bool:
    """A higher-order op the bridge does not inline (a custom Function with its own backward), or
    a node ``named`` (one the bridge could not convert)."""
    if node.op in ("placeholder", "get_attr", "output"):
        return False
    return node.name in named or (
        node.op == "call_function"
        and isinstance(node.target, HigherOrderOperator)
        and getattr(node.target, "__name__", "") not in INLINED
    )


def _writes_an_input(node: torch.fx.Node) -> bool:
    name = str(getattr(node.target, "__name__", node.target))
    first = node.args[0] if node.args else None
    return (
        node.op in ("call_method", "call_function")
        and name.endswith("_")
        and not name.startswith("_")
        and isinstance(first, torch.fx.Node)
        and first.op == "placeholder"
    )


def _barrier(node: torch.fx.Node, named: frozenset[str]) -> bool:
    """Where a piece must end: PyTorch runs this node, in its place in the graph."""
    if runs_in_pytorch(node, named) or getattr(node.target, "__name__", "") in _STATEFUL or _writes_an_input(node):
        return True
    # the results of an op PyTorch runs are taken apart where it runs
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], torch.fx.Node)
        and runs_in_pytorch(node.args[0], named)
    )


def needs_split(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph holds an op TVM cannot run as PyTorch does."""
    return any(runs_in_pytorch(n) for n in gm.graph.nodes)


def _runs(gm: torch.fx.GraphModule, named: frozenset[str]) -> list[dict[torch.fx.Node, int | None]]:
    """The runs of computing nodes between barriers, in graph order (``fuse_by_partitions``'s
    partitions: ordered dicts, no node given a position)."""
    runs: list[dict[torch.fx.Node, int | None]] = [{}]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue  # inputs, the op's bodies and the output stay in the split graph
        if _barrier(node, named):
            runs.append({})
        else:
            runs[-1][node] = None
    return [r for r in runs if r]


def split(
    gm: torch.fx.GraphModule, named: frozenset[str] = frozenset()
) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """``gm`` with its compilable runs as submodules: the split graph, the pieces' names, and
    what PyTorch runs between them (for ``explain``). ``named``: nodes PyTorch runs too."""
    fused = fuse_by_partitions(gm, _runs(gm, named), prefix="tvm_piece_")
    pieces = [n.target for n in fused.graph.nodes if n.op == "call_module" and n.target.startswith("tvm_piece_")]
    kept = [str(getattr(n.target, "__name__", n.target)) for n in fused.graph.nodes if runs_in_pytorch(n, named)]
    return fused, pieces, kept


def grad_modes(fused: torch.fx.GraphModule, start: bool) -> dict[str, bool]:
    """The grad mode each piece of a split graph runs under: ``start`` (the mode dynamo captured
    the graph under), then as each ``_set_grad_enabled`` barrier before it leaves it."""
    mode, modes = start, {}
    for node in fused.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_set_grad_enabled":
            mode = bool(node.args[0])
        elif node.op == "call_module" and str(node.target).startswith("tvm_piece_"):
            modes[str(node.target)] = mode
    return modes
