"""The ordering problem the scheduler solves: a DataflowGraph reduced to its allocating nodes.

A node that allocates nothing (a view, an in-place update, a detach) never sets the peak: while
it runs, only what was live after the previous node is live, and running it as soon as its
inputs are ready only ends its inputs' lives earlier. So some optimal order runs each such node
right after the last of its predecessors, and the problem keeps only the allocating nodes
(`ScheduleProblem.nodes`, a third of a training graph): a zero-allocation node becomes its
*anchors*, the allocating nodes it waits for, a tensor it reads lives until all of its anchors
ran, and its successors wait for its anchors. `expand` puts the zero-allocation nodes back.
Memory at a step of the reduced problem equals `simulate` of the expanded order at that node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from analysis.memory.dataflow import OUTPUT, DataflowGraph

# `lower_bound` builds dense reachability matrices; above this many nodes it gives up (None)
MAX_BOUND_NODES = 12_000


@dataclass(frozen=True)
class Tensor:
    """An allocation of the problem: alive from `src`'s step until every node in `sinks` ran
    (only at `src`'s step if none), or to the end when `to_end`. Sinks need not depend on
    `src`: a zero-allocation reader runs after its last anchor, whichever that is."""

    name: str
    size: int
    src: int
    sinks: tuple[int, ...]
    to_end: bool


@dataclass
class ScheduleProblem:
    """Allocating nodes `nodes` (program order, indices used everywhere), their dependencies
    `preds`, the tensors, and how to put the removed nodes back."""

    graph: DataflowGraph
    nodes: list[str]
    preds: list[list[int]]
    tensors: list[Tensor]
    resident: int
    zero: list[str]  # zero-allocation nodes, program order
    anchors: dict[str, frozenset[int]]  # zero-allocation node -> allocating nodes it waits for
    outputs: list[str]  # OUTPUT nodes: they run last
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {n: i for i, n in enumerate(self.nodes)}

    def __len__(self) -> int:
        return len(self.nodes)

    def deps(self) -> list[tuple[int, int]]:
        return [(p, s) for s, ps in enumerate(self.preds) for p in ps]

    # ---- orders ---------------------------------------------------------------------------
    def project(self, order: Sequence[str]) -> list[int]:
        """The allocating nodes of a full order, in its order (expanding it back never raises
        the peak: the removed nodes only move earlier)."""
        return [self.index[n] for n in order if n in self.index]

    def expand(self, order: Sequence[int]) -> list[str]:
        """A full order of the graph: `order` with each zero-allocation node right after the
        last of its anchors (at the start if it has none), OUTPUT nodes last."""
        step = {v: t for t, v in enumerate(order)}
        topo = {n: i for i, n in enumerate(self.zero)}
        keys: list[tuple[int, int, int, str]] = [(t, 0, 0, self.nodes[v]) for v, t in step.items()]
        for n in self.zero:
            keys.append((max((step[a] for a in self.anchors[n]), default=-1), 1, topo[n], n))
        return [k[3] for k in sorted(keys)] + self.outputs

    def check(self, order: Sequence[int]) -> None:
        """Raise ValueError unless `order` runs every node once, after its predecessors."""
        pos = {v: t for t, v in enumerate(order)}
        if len(pos) != len(order) or sorted(pos) != list(range(len(self.nodes))):
            raise ValueError("order must list every node of the problem once")
        for s, ps in enumerate(self.preds):
            if any(pos[p] >= pos[s] for p in ps):
                raise ValueError(f"order runs {self.nodes[s]!r} before a predecessor")

    def memory(self, order: Sequence[int]) -> list[int]:
        """Live bytes at each step of `order` (resident bytes included)."""
        T = len(order)
        pos = np.empty(len(self.nodes), dtype=np.int64)
        pos[np.asarray(order, dtype=np.int64)] = np.arange(T)
        delta = np.zeros(T + 1, dtype=np.int64)
        for e in self.tensors:
            a = pos[e.src]
            b = T - 1 if e.to_end else max([a] + [pos[s] for s in e.sinks])
            delta[a] += e.size
            delta[b + 1] -= e.size
        return (np.cumsum(delta[:T]) + self.resident).tolist()

    def peak(self, order: Sequence[int]) -> int:
        return max(self.memory(order), default=self.resident)

    # ---- structure --------------------------------------------------------------------------
    def reach(self) -> tuple[list[int], list[int]]:
        """Ancestor and descendant bit sets of every node (Python ints, bit i = node i)."""
        n = len(self.nodes)
        anc = [0] * n
        for v in range(n):  # nodes are in a topological order
            for p in self.preds[v]:
                anc[v] |= anc[p] | (1 << p)
        desc = [0] * n
        for v in reversed(range(n)):
            for p in self.preds[v]:
                desc[p] |= desc[v] | (1 << v)
        return anc, desc

    def windows(self) -> list[tuple[int, int]]:
        """[ASAP, ALAP] step of each node: it needs its ancestors before and its descendants
        after it."""
        anc, desc = self.reach()
        last = len(self.nodes) - 1
        return [(anc[v].bit_count(), last - desc[v].bit_count()) for v in range(len(self.nodes))]

    def lower_bound(self, order: Sequence[int] | None = None) -> int | None:
        """A peak no order can beat (None when the graph is too big for dense matrices).

        While node v runs, the nodes run before it are a set S closed under predecessors that
        holds v's ancestors and none of its descendants; a tensor is live if v made it, or S
        holds its source and not all its sinks. The cheapest S for v is a minimum cut, and the
        bound is the largest over v. Cuts are computed only for nodes whose step in `order`
        (default: program order, an order the cut cannot beat) is above the bound so far,
        after the cheap bound of the tensors live at v whatever S is."""
        n = len(self.nodes)
        if n > MAX_BOUND_NODES:
            return None
        if n == 0:
            return self.resident
        anc_m, desc_m = _closure_matrices(self.preds)
        certain = np.zeros(n)
        for e in self.tensors:
            live = (
                desc_m[e.src]
                if e.to_end
                else (desc_m[e.src] & np.logical_or.reduce(anc_m[list(e.sinks) + [e.src]], axis=0))
            )
            certain += e.size * live
        mem = self.memory(range(n) if order is None else order)
        at = dict(zip(range(n) if order is None else order, mem))
        best = self.resident + int(certain.max())
        for v in sorted(range(n), key=lambda v: -at[v]):
            if at[v] <= best:
                break
            best = max(best, self.resident + _cut_bound(self, v, anc_m, desc_m))
        return best


def _closure_matrices(preds: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(A, D): A[s, v] = v is s or an ancestor of s; D[u, v] = v is u or a descendant of u."""
    n = len(preds)
    anc = np.eye(n, dtype=bool)
    for v in range(n):
        for p in preds[v]:
            anc[v] |= anc[p]
    return anc, anc.T.copy()


INF = 1 << 50  # an uncuttable capacity (bytes of any real graph stay far below)


def _cut_bound(prob: ScheduleProblem, v: int, anc_m: np.ndarray, desc_m: np.ndarray) -> int:
    """Bytes live while v runs after the cheapest set S of earlier nodes (see `lower_bound`):
    what v makes, what is live for any S, and a minimum cut over the nodes free to be on
    either side. Cut network: source side = S; a tensor with free source s pays its size
    through s -> x_e when x_e is outside S, and x_e -> each free sink (infinite) puts x_e out
    when a sink is out; w -> p (infinite) for p a predecessor of w keeps S closed."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import maximum_flow

    inside, outside = anc_m[v].copy(), desc_m[v]
    inside[v] = False
    free = ~(inside | outside)
    ids = {int(u): 2 + k for k, u in enumerate(np.flatnonzero(free))}
    rows: list[int] = []
    cols: list[int] = []
    caps: list[int] = []
    fixed = 0

    def arc(a: int, b: int, cap: int) -> None:
        rows.append(a)
        cols.append(b)
        caps.append(cap)

    for w in ids:
        for p in prob.preds[w]:
            if p in ids:
                arc(ids[w], ids[p], INF)
    for e in prob.tensors:
        if e.src == v:
            fixed += e.size
        elif outside[e.src]:
            continue
        elif e.to_end or any(outside[x] for x in e.sinks):
            if inside[e.src]:
                fixed += e.size
            else:
                arc(ids[e.src], 1, e.size)
        elif any(free[x] for x in e.sinks):
            x_e = 2 + len(ids) + len(caps)  # a fresh node number
            arc(0 if inside[e.src] else ids[e.src], x_e, e.size)
            for x in e.sinks:
                if free[x]:
                    arc(x_e, ids[x], INF)
    if not caps:
        return fixed
    size = max(max(rows), max(cols)) + 1
    net = coo_matrix((np.asarray(caps, np.int64), (rows, cols)), shape=(size, size)).tocsr()
    return fixed + int(maximum_flow(net, 0, 1).flow_value)


def _anchors(graph: DataflowGraph, kept: set[str], ops: list[str], index: dict[str, int]) -> dict[str, frozenset[int]]:
    """For each zero-allocation node (in program order), the allocating nodes it waits for."""
    pred = graph.predecessors()
    opset = set(ops)
    anchors: dict[str, frozenset[int]] = {}
    for n in ops:
        if n in kept:
            continue
        acc: set[int] = set()
        for p in pred[n]:
            if p in kept:
                acc.add(index[p])
            elif p in anchors:
                acc |= anchors[p]
            elif p in opset:
                raise ValueError(f"{p!r} comes after its successor {n!r} in program order")
        anchors[n] = frozenset(acc)
    return anchors


def _effective(names: Sequence[str], kept_index: dict[str, int], anchors: dict[str, frozenset[int]]) -> set[int]:
    out: set[int] = set()
    for n in names:
        if n in kept_index:
            out.add(kept_index[n])
        elif n in anchors:
            out |= anchors[n]
    return out


def reduce_graph(graph: DataflowGraph, order: Sequence[str] | None = None) -> ScheduleProblem:
    """The problem of ordering `graph`'s allocating op nodes (module docstring). `order`, a
    topological order of the graph, fixes the node indices (default: program order)."""
    order = [n for n in (order or graph.program_order()) if not graph.nodes[n].resident]
    outputs = [n for n in order if graph.nodes[n].kind == OUTPUT]
    ops = [n for n in order if graph.nodes[n].kind != OUTPUT]
    kept_list = [n for n in ops if any(graph.edges[e].size > 0 for e in graph.nodes[n].outputs)]
    kept = set(kept_list)
    index = {n: i for i, n in enumerate(kept_list)}
    anchors = _anchors(graph, kept, ops, index)
    pred = graph.predecessors()
    preds = [sorted(_effective(pred[n], index, anchors)) for n in kept_list]
    tensors = []
    for e in graph.edges.values():
        if e.size == 0 or e.src not in index:
            continue
        to_end = e.is_output or any(graph.nodes[s].kind == OUTPUT for s in e.sinks)
        sinks = _effective(e.sinks, index, anchors) - {index[e.src]}
        tensors.append(Tensor(e.name, e.size, index[e.src], tuple(sorted(sinks)), to_end))
    return ScheduleProblem(
        graph, kept_list, preds, tensors, graph.resident_bytes(), [n for n in ops if n not in kept], anchors, outputs
    )
