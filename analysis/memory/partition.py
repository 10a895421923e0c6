"""Choosing what the backward keeps and what it recomputes: a min-cut over the joint graph.

In the style of AOTAutograd's ``min_cut_rematerialization_partition``: every forward value ``v``
becomes an edge ``v_in -> v_out`` whose capacity is the bytes it would cost to keep ``v`` for the
backward; values the backward reads are tied to the sink, inputs (free to keep: PyTorch holds them
anyway) and values that must not be recomputed are tied to the source. A minimum s-t cut then
separates "computed in forward" from "computed in backward"; the cut edges are the values to keep,
everything else the backward needs is recomputed. The cut is the cheapest set of bytes that lets
the backward run with only cheap ops recomputed.

Pure Python over networkx; no TVM. ``tvmbridge.partition.policy`` builds a :class:`PartitionGraph` from
a Relax adjoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov


@dataclass
class PartitionNode:
    """A forward value: its bytes, whether recomputing it is allowed, its recompute cost."""

    name: str
    inputs: list[str]
    nbytes: int
    recomputable: bool
    flops: float = 0.0
    is_input: bool = False  # a function input (parameter, user input, mask): always available
    keepable: bool | None = None  # can be kept (a tensor); None: when it has bytes (> 0)

    def can_keep(self) -> bool:
        return self.nbytes > 0 if self.keepable is None else self.keepable


@dataclass
class PartitionGraph:
    nodes: dict[str, PartitionNode]
    backward_reads: set[str]  # forward values the backward part reads directly

    def users(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n: [] for n in self.nodes}
        for node in self.nodes.values():
            for i in node.inputs:
                if i in out:
                    out[i].append(node.name)
        return out


@dataclass
class Partition:
    saved: list[str]
    recomputed: list[str]
    saved_bytes: int
    recompute_flops: float
    unbanned: list[str] = field(default_factory=list)


def min_cut(graph: PartitionGraph, banned: set[str] | None = None) -> Partition:
    """Minimum-bytes set of values to keep, recomputing only ``recomputable`` values not in
    ``banned`` (default: all non-recomputable)."""
    if banned is None:
        banned = {n for n, v in graph.nodes.items() if not v.recomputable}
    g = nx.DiGraph()
    inf = math.inf
    users = graph.users()
    for name, node in graph.nodes.items():
        vin, vout = f"{name}_in", f"{name}_out"
        if node.is_input:
            g.add_edge("source", vin, capacity=inf)
            g.add_edge(vin, vout, capacity=0)
        else:
            if name in banned:
                g.add_edge("source", vin, capacity=inf)
            # a value that is no tensor (a tuple) can never be kept, only recomputed; a tensor with
            # a zero-size dimension is kept for free
            g.add_edge(vin, vout, capacity=node.nbytes if node.can_keep() else inf)
        if name in graph.backward_reads:
            g.add_edge(vout, "sink", capacity=inf)
        for u in users[name]:
            g.add_edge(vout, f"{u}_in", capacity=inf)
    if "sink" not in g:
        return Partition([], [], 0, 0.0)
    try:
        # Boykov-Kolmogorov: the same cut (the source side reachable in the residual graph is
        # the same for every maximum flow), in about two thirds of preflow-push's time here
        _, (reachable, non_reachable) = nx.minimum_cut(g, "source", "sink", flow_func=boykov_kolmogorov)
    except nx.NetworkXUnbounded:
        raise ValueError("no finite cut: a value the backward needs can neither be kept nor recomputed") from None
    saved = [
        n
        for n, node in graph.nodes.items()
        if not node.is_input and f"{n}_in" in reachable and f"{n}_out" in non_reachable
    ]
    # recomputed: on the sink side and needed by the backward (through other recomputed values)
    need: set[str] = set()
    stack = [n for n in graph.backward_reads if n in graph.nodes]
    saved_set = set(saved)
    while stack:
        n = stack.pop()
        if n in need or n in saved_set or graph.nodes[n].is_input:
            continue
        need.add(n)
        stack.extend(i for i in graph.nodes[n].inputs if i in graph.nodes)
    recomputed = [n for n in graph.nodes if n in need]
    return Partition(
        saved=saved,
        recomputed=recomputed,
        saved_bytes=sum(graph.nodes[n].nbytes for n in saved),
        recompute_flops=sum(graph.nodes[n].flops for n in recomputed),
    )


def _banned_frontier(graph: PartitionGraph, saved: list[str], banned: set[str]) -> list[str]:
    """Banned values that force a saved value: the saved value itself if banned, else the nearest
    banned ancestors it is computed from through recomputable values."""
    out: list[str] = []
    seen: set[str] = set()
    stack = list(saved)
    while stack:
        n = stack.pop()
        if n in seen or n not in graph.nodes or graph.nodes[n].is_input:
            continue
        seen.add(n)
        if n in banned:
            out.append(n)
            continue
        stack.extend(graph.nodes[n].inputs)
    return out


def min_cut_with_budget(graph: PartitionGraph, budget_bytes: int | None) -> Partition:
    """Min-cut, then, while the kept bytes exceed ``budget_bytes``, allow recomputing the banned
    value with the lowest recompute FLOPs per byte it frees, until the budget is met or nothing is
    left to unban. The result says which values were unbanned."""
    banned = {n for n, v in graph.nodes.items() if not v.recomputable and not v.is_input}
    best = min_cut(graph, banned)
    unbanned: list[str] = []
    if budget_bytes is None:
        return best
    while best.saved_bytes > budget_bytes:
        candidates = _banned_frontier(graph, best.saved, banned)
        if not candidates:
            break
        pick = min(candidates, key=lambda n: graph.nodes[n].flops / max(1, graph.nodes[n].nbytes))
        banned.discard(pick)
        unbanned.append(pick)
        best = min_cut(graph, banned)
    best.unbanned = unbanned
    return best
