"""Memory simulator: live bytes at every step of an order over a DataflowGraph.

Convention (shared with the scheduler's ILP and with `measure_fx_peak`): while a node runs, its
inputs and its outputs are all resident; a tensor is allocated when its producer runs and freed
right after its last consumer ran (graph outputs stay until the end; a tensor nobody reads lives
only during its producer's step). Resident nodes' tensors count at every step. Scratch space that
a kernel uses internally is not modelled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from analysis.memory.dataflow import DataflowGraph


@dataclass
class MemoryProfile:
    """Result of a simulation: `memory[i]` is the live bytes while `order[i]` runs."""

    order: list[str]
    memory: list[int]
    resident: int

    @property
    def peak(self) -> int:
        return max(self.memory, default=self.resident)

    @property
    def peak_step(self) -> int:
        return max(range(len(self.memory)), key=self.memory.__getitem__) if self.memory else -1

    @property
    def peak_node(self) -> str | None:
        return self.order[self.peak_step] if self.memory else None


def lifetimes(graph: DataflowGraph, order: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Edge name -> (first step, last step) it is live, for non-resident edges with size > 0."""
    pos = {n: i for i, n in enumerate(order)}
    end = len(order) - 1
    out: dict[str, tuple[int, int]] = {}
    for e in graph.edges.values():
        if e.size == 0 or graph.nodes[e.src].resident:
            continue
        start = pos[e.src]
        last = end if e.is_output else max((pos[s] for s in e.sinks), default=start)
        out[e.name] = (start, last)
    return out


def simulate(graph: DataflowGraph, order: Sequence[str] | None = None, check: bool = True) -> MemoryProfile:
    """Simulate `order` (default: program order); resident nodes in it are skipped."""
    if order is None:
        order = graph.program_order()
    # unknown names are kept so that check_order reports them
    order = [n for n in order if n not in graph.nodes or not graph.nodes[n].resident]
    if check:
        graph.check_order(order)
    resident = graph.resident_bytes()
    delta = [0] * (len(order) + 1)
    for e_name, (a, b) in lifetimes(graph, order).items():
        size = graph.edges[e_name].size
        delta[a] += size
        delta[b + 1] -= size
    memory, cur = [], resident
    for i in range(len(order)):
        cur += delta[i]
        memory.append(cur)
    return MemoryProfile(list(order), memory, resident)


def peak_memory(graph: DataflowGraph, order: Sequence[str] | None = None) -> int:
    return simulate(graph, order).peak


# ---- validation against a real execution ------------------------------------------------
def _storages(value: Any, acc: dict[Any, int]) -> None:
    from analysis.tensors import storage_key, tensor_leaves

    for t in tensor_leaves(value):
        acc[storage_key(t)] = t.untyped_storage().nbytes()


def _fx_sequence(graph: Any, order: Sequence[str] | None) -> list[Any]:
    """FX nodes to run: the graph's own order, or `order` (dataflow node names) with each
    folded getitem right after its producer and placeholders first, output last."""
    import operator

    nodes = list(graph.nodes)
    if order is None:
        return nodes
    by_name = {n.name: n for n in nodes}
    seq = [n for n in nodes if n.op in ("placeholder", "get_attr")]
    seen = set(seq)
    for name in order:
        n = by_name[name]
        if n in seen or n.op == "output":
            continue
        seq.append(n)
        seen.add(n)
        for u in n.users:
            if u.op == "call_function" and u.target is operator.getitem and u not in seen:
                seq.append(u)
                seen.add(u)
    rest = [n for n in nodes if n not in seen and n.op != "output"]
    if any(n.op != "call_function" or n.users for n in rest):
        raise ValueError(f"order leaves out FX nodes, e.g. {[n.name for n in rest[:3]]}")
    return seq + rest + [n for n in nodes if n.op == "output"]


def measure_fx_peak(gm: Any, *args: Any, order: Sequence[str] | None = None) -> tuple[int, list[int], Any]:
    """Run an FX GraphModule node by node on real tensors: (peak, bytes per node, result).

    With `order` (names of the importer's dataflow nodes) the nodes run in that order instead,
    which shows that a schedule keeps its simulated peak and the program's results.

    Live memory is the set of distinct storages among the caller's arguments and the values
    still referenced by a later node (what FX's generated code keeps), measured right after
    each node ran and before its dead inputs are dropped, so it follows the simulator's
    convention.
    """
    import torch
    import torch.fx

    nodes = _fx_sequence(gm.graph, order)
    last_use: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a] = i
    flat_args = list(torch.utils._pytree.tree_leaves(list(args)))
    env: dict[torch.fx.Node, Any] = {}
    held: dict[Any, int] = {}
    _storages(flat_args, held)
    per_node: list[int] = []
    arg_iter = iter(flat_args)
    result: Any = None
    with torch.no_grad():
        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                env[n] = next(arg_iter)
                continue
            if n.op == "output":
                result = torch.fx.node.map_arg(n.args[0], lambda x: env[x])
                break
            a = torch.fx.node.map_arg(n.args, lambda x: env[x])
            kw = torch.fx.node.map_arg(n.kwargs, lambda x: env[x])
            if n.op == "call_function":
                env[n] = n.target(*a, **kw)
            elif n.op == "get_attr":
                obj: Any = gm
                for part in str(n.target).split("."):
                    obj = getattr(obj, part)
                env[n] = obj
            elif n.op == "call_method":
                env[n] = getattr(a[0], n.target)(*a[1:], **kw)
            elif n.op == "call_module":
                env[n] = gm.get_submodule(n.target)(*a, **kw)
            live = dict(held)
            for v in env.values():
                _storages(v, live)
            per_node.append(sum(live.values()))
            for a_node in n.all_input_nodes:
                if last_use.get(a_node) == i and a_node.op != "placeholder":
                    env.pop(a_node, None)
            if n not in last_use and n.op != "placeholder":
                env.pop(n, None)  # result nobody reads: freed at once
    return max(per_node, default=sum(held.values())), per_node, result
