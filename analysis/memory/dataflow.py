"""Dataflow graph of a program for memory analysis: operator nodes and tensor edges with sizes.

Kept free of torch so that the simulator and the scheduler can be tested on hand-made graphs.
An edge is one *allocation* (a storage), produced by one node and read by all its sinks; views
and in-place results are zero-size edges that only carry the ordering. A sink may also only
*hold* an edge (`Edge.holders`): PyTorch keeps the storage referenced until that node ran (an
autograd node's saved tensors, a backward formula's temporaries), so it lives as if read there. Nodes whose kind is in
`RESIDENT_KINDS` (weights, optimizer state, inputs, constants) own memory that the caller holds
for the whole step, so it counts at every step and no order can change it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# node kinds
INPUT, WEIGHT, OPT_STATE, CONSTANT = "input", "weight", "optimizer_state", "constant"
FORWARD, BACKWARD, OPTIMIZER, OUTPUT, OP = "forward", "backward", "optimizer", "output", "op"
RESIDENT_KINDS = frozenset({INPUT, WEIGHT, OPT_STATE, CONSTANT})
# edge kinds
ACTIVATION, GRADIENT, OPT_TEMP, CONTROL, ALIAS = ("activation", "gradient", "optimizer_temp", "control", "alias")


@dataclass
class Node:
    """One operator (or a graph input). `kind` says which phase of a training step it is in."""

    name: str
    kind: str = OP
    op: str = ""
    inputs: list[str] = field(default_factory=list)  # edge names read
    outputs: list[str] = field(default_factory=list)  # edge names produced

    @property
    def resident(self) -> bool:
        return self.kind in RESIDENT_KINDS


@dataclass
class Edge:
    """One tensor: `size` bytes allocated when `src` runs, freed after the last of `sinks` ran.

    `is_output` marks tensors handed back to the caller (or held by PyTorch until the step
    returns): they stay alive until the end. `holders` are the sinks that only hold it.
    """

    name: str
    src: str
    sinks: list[str] = field(default_factory=list)
    size: int = 0
    kind: str = ACTIVATION
    is_output: bool = False
    holders: list[str] = field(default_factory=list)


class GraphError(ValueError):
    """The graph or an order over it is malformed (unknown names, cycles, non-topological)."""


class DataflowGraph:
    """Nodes in insertion order (taken as the program's own order) plus tensor edges."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.edges: dict[str, Edge] = {}

    # ---- construction -------------------------------------------------------------------
    def add_node(self, name: str, kind: str = OP, op: str = "") -> Node:
        if name in self.nodes:
            raise GraphError(f"duplicate node {name!r}")
        node = Node(name, kind, op)
        self.nodes[name] = node
        return node

    def add_edge(
        self,
        name: str,
        src: str,
        sinks: Iterable[str] = (),
        size: int = 0,
        kind: str = ACTIVATION,
        is_output: bool = False,
    ) -> Edge:
        if name in self.edges:
            raise GraphError(f"duplicate edge {name!r}")
        if src not in self.nodes:
            raise GraphError(f"edge {name!r}: unknown source node {src!r}")
        if size < 0:
            raise GraphError(f"edge {name!r}: negative size {size}")
        edge = Edge(name, src, [], int(size), kind, is_output)
        self.edges[name] = edge
        self.nodes[src].outputs.append(name)
        for s in sinks:
            self.add_sink(name, s)
        return edge

    def add_sink(self, edge: str, sink: str) -> None:
        """Make `sink` read `edge` (idempotent)."""
        e = self.edges[edge]
        if sink not in self.nodes:
            raise GraphError(f"edge {edge!r}: unknown sink node {sink!r}")
        if sink == e.src:
            raise GraphError(f"edge {edge!r}: node {sink!r} cannot read its own output")
        if sink not in e.sinks:
            e.sinks.append(sink)
            self.nodes[sink].inputs.append(edge)

    def add_hold(self, edge: str, holder: str) -> None:
        """`holder` keeps `edge` alive until it ran without reading it (a sink for memory and
        for the order)."""
        self.add_sink(edge, holder)
        if holder not in self.edges[edge].holders:
            self.edges[edge].holders.append(holder)

    # ---- queries ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.nodes)

    def program_order(self) -> list[str]:
        """The order the nodes were added in (for an imported graph: PyTorch's own order)."""
        return list(self.nodes)

    def op_nodes(self) -> list[str]:
        """Nodes that run (not resident inputs), in program order."""
        return [n for n, node in self.nodes.items() if not node.resident]

    def successors(self) -> dict[str, list[str]]:
        succ: dict[str, list[str]] = {n: [] for n in self.nodes}
        for e in self.edges.values():
            for s in e.sinks:
                if s not in succ[e.src]:
                    succ[e.src].append(s)
        return succ

    def predecessors(self) -> dict[str, list[str]]:
        pred: dict[str, list[str]] = {n: [] for n in self.nodes}
        for e in self.edges.values():
            for s in e.sinks:
                if e.src not in pred[s]:
                    pred[s].append(e.src)
        return pred

    def resident_bytes(self) -> int:
        """Memory held by the caller for the whole step (weights, state, inputs, constants)."""
        return sum(e.size for e in self.edges.values() if self.nodes[e.src].resident)

    def memory_edges(self) -> list[Edge]:
        return [e for e in self.edges.values() if e.size > 0]

    def stats(self) -> dict[str, int]:
        return {
            "nodes": len(self.nodes),
            "edges": len(self.edges),
            "op_nodes": len(self.op_nodes()),
            "memory_edges": len(self.memory_edges()),
        }

    # ---- orders -------------------------------------------------------------------------
    def check_order(self, order: Sequence[str]) -> None:
        """Raise GraphError unless `order` lists every node once, each after its producers.

        Resident nodes may be omitted (they exist before the step starts).
        """
        pos: dict[str, int] = {}
        for i, n in enumerate(order):
            if n not in self.nodes:
                raise GraphError(f"order names unknown node {n!r}")
            if n in pos:
                raise GraphError(f"order lists node {n!r} twice")
            pos[n] = i
        missing = [n for n in self.op_nodes() if n not in pos]
        if missing:
            raise GraphError(f"order misses {len(missing)} node(s), e.g. {missing[:3]}")
        for e in self.edges.values():
            if self.nodes[e.src].resident:
                continue
            for s in e.sinks:
                if pos[s] <= pos[e.src]:
                    raise GraphError(
                        f"order is not topological: {s!r} (step {pos[s]}) reads {e.name!r} "
                        f"made by {e.src!r} (step {pos[e.src]})"
                    )

    def is_topological(self, order: Sequence[str]) -> bool:
        try:
            self.check_order(order)
        except GraphError:
            return False
        return True

    def validate(self) -> None:
        """Raise GraphError on cycles; the program order must itself be topological."""
        self.check_order(self.program_order())

    def to_networkx(self):  # -> networkx.DiGraph, imported lazily
        """Op nodes and their dependencies as a networkx DiGraph (for brute force / drawing)."""
        import networkx as nx

        g = nx.DiGraph()
        ops = set(self.op_nodes())
        g.add_nodes_from(self.op_nodes())
        for e in self.edges.values():
            if e.src in ops:
                g.add_edges_from((e.src, s) for s in e.sinks)
        return g
