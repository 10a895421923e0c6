"""A traced step as a dataflow graph: one node per FX node, one edge per allocation.

Aliasing is read from the traced values' storages; an op's writes from its schema's alias
annotations; lifetimes from when PyTorch released each tensor while tracing (``ReleaseWatch``),
or from the last reader. The rules are in ``analysis.memory.importer``'s docstring.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from analysis.memory.dataflow import (
    ACTIVATION,
    ALIAS,
    BACKWARD,
    CONSTANT,
    CONTROL,
    FORWARD,
    GRADIENT,
    OPT_TEMP,
    OPTIMIZER,
    OUTPUT,
    DataflowGraph,
)
from analysis.tensors import storage_key

if TYPE_CHECKING:
    from analysis.memory.importer import TracedStep

_EDGE_KIND = {FORWARD: ACTIVATION, BACKWARD: GRADIENT, OPTIMIZER: OPT_TEMP, OUTPUT: ACTIVATION}


def _outputs_by_index(val: Any) -> list[torch.Tensor | None]:
    """Outputs of an FX node's value, by output index (non-tensors as None)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _written_args(node: torch.fx.Node) -> list[Any]:
    """Arguments that the op writes to, from its schema's alias annotations (`Tensor(a!)`)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        if arg.kwarg_only or i >= len(node.args):
            if arg.name in node.kwargs:
                out.append(node.kwargs[arg.name])
        else:
            out.append(node.args[i])
    return out


class _DataflowBuilder:
    """Walks the FX graph once, adding a dataflow node per FX node and an edge per allocation."""

    def __init__(self, traced: TracedStep, eager_lifetimes: bool = True) -> None:
        self.traced = traced
        self.eager_lifetimes = eager_lifetimes
        self.g = DataflowGraph()
        self.value_edge: dict[tuple[torch.fx.Node, int], str] = {}  # (fx node, output) -> data edge
        self.value_storage: dict[tuple[torch.fx.Node, int], StorageWeakRef] = {}
        self.base_edge: dict[StorageWeakRef, str] = {}  # storage -> allocation edge
        self.last_writer: dict[StorageWeakRef, str] = {}
        self.readers: dict[StorageWeakRef, set[str]] = {}
        self.ctrl: dict[str, str] = {}
        self.placeholder_i = 0

    def build(self) -> DataflowGraph:
        for index, n in enumerate(self.traced.gm.graph.nodes):
            if n.op == "call_function" and n.target is operator.getitem:
                continue  # folded into its producer
            kind = self._kind(n, index)
            if kind is None:
                continue
            self.g.add_node(n.name, kind, str(n.target) if n.op != "placeholder" else "placeholder")
            reads = self._add_reads(n)
            self._add_writes(n)
            if n.op == "output":
                for key in reads:
                    self.g.edges[self.base_edge[self.value_storage[key]]].is_output = True
                continue
            self._add_outputs(n, kind, index)
        if self.eager_lifetimes:
            self._add_holds()
        self.g.validate()
        return self.g

    def _add_holds(self) -> None:
        """Extend each allocation to where PyTorch released it while tracing (`ReleaseWatch`):
        a hold on the op that ran last before the release, when that is after the last
        reader; a storage never released lives to the end of the step."""
        fx_nodes = list(self.traced.gm.graph.nodes)
        pos = {n: i for i, n in enumerate(self.g.nodes)}
        for st, e_name in self.base_edge.items():
            e = self.g.edges[e_name]
            if st not in self.traced.released or e.is_output or self.g.nodes[e.src].resident:
                continue
            at = self.traced.released[st]
            if at is None or at >= len(fx_nodes) or fx_nodes[at - 1].op == "output":
                e.is_output = True
                continue
            holder = fx_nodes[at - 1]
            if holder.op == "call_function" and holder.target is operator.getitem:
                holder = holder.args[0]
            if holder.name not in pos or self.g.nodes[holder.name].resident:
                continue
            if pos[holder.name] > max([pos[s] for s in e.sinks] + [pos[e.src]]):
                self.g.add_hold(e_name, holder.name)

    def _kind(self, n: torch.fx.Node, index: int) -> str | None:
        """The node's kind; None for an input nothing uses (dropped)."""
        if n.op in ("placeholder", "get_attr"):
            kind = self.traced.input_kinds[self.placeholder_i] if n.op == "placeholder" else CONSTANT
            self.placeholder_i += n.op == "placeholder"
            return kind if n.users else None
        return OUTPUT if n.op == "output" else self.traced.phase_of(index)

    def _control(self, src: str, dst: str) -> None:
        if src == dst:
            return
        if src not in self.ctrl:
            self.ctrl[src] = self.g.add_edge(f"{src}:ctrl", src, kind=CONTROL).name
        self.g.add_sink(self.ctrl[src], dst)

    def _resolve(self, a: torch.fx.Node) -> list[tuple[torch.fx.Node, int]]:
        """Fold getitem: the (producer, output index) pairs a node argument stands for."""
        if a.op == "call_function" and a.target is operator.getitem:
            src, idx = a.args[0], a.args[1]
            if isinstance(src, torch.fx.Node) and isinstance(idx, int) and (src, idx) in self.value_edge:
                return [(src, idx)]
            return []
        return [(a, i) for i in range(len(_outputs_by_index(a.meta.get("val")))) if (a, i) in self.value_edge]

    def _add_reads(self, n: torch.fx.Node) -> list[tuple[torch.fx.Node, int]]:
        reads: list[tuple[torch.fx.Node, int]] = []
        for a in n.all_input_nodes:
            reads.extend(self._resolve(a))
        for key in reads:
            self.g.add_sink(self.value_edge[key], n.name)
            st = self.value_storage[key]
            self.g.add_sink(self.base_edge[st], n.name)
            if st in self.last_writer:
                self._control(self.last_writer[st], n.name)  # read after write
            self.readers.setdefault(st, set()).add(n.name)
        return reads

    def _add_writes(self, n: torch.fx.Node) -> None:
        for w in _written_args(n):
            for key in self._resolve(w) if isinstance(w, torch.fx.Node) else []:
                st = self.value_storage[key]
                for r in self.readers.get(st, ()):  # write after read
                    self._control(r, n.name)
                if st in self.last_writer:
                    self._control(self.last_writer[st], n.name)
                self.last_writer[st] = n.name
                self.readers[st] = set()

    def _in_place_sum(self, n: torch.fx.Node, index: int, t: torch.Tensor) -> StorageWeakRef | None:
        """The buffered gradient's storage if PyTorch's engine adds into it in place here: an
        autograd gradient sum (`ReleaseWatch`) that held the last reference to a dense buffer
        of the result's size."""
        old = self.traced.accumulations.get(index) if self.eager_lifetimes else None
        if old is None or old not in self.base_edge or self.traced.released.get(old) != index + 1:
            return None
        val = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        same = (
            isinstance(val, torch.Tensor)
            and val.shape == t.shape
            and val.dtype == t.dtype
            and val.is_contiguous()
            and t.is_contiguous()
        )
        return old if same else None

    def _add_outputs(self, n: torch.fx.Node, kind: str, index: int) -> None:
        for i, t in enumerate(_outputs_by_index(n.meta.get("val"))):
            if t is None:
                continue
            st = storage_key(t)
            name = f"{n.name}:{i}" if i else n.name
            into = self._in_place_sum(n, index, t) if i == 0 else None
            if into is not None:  # the engine's in-place gradient sum: the buffer's memory
                self.value_edge[(n, i)] = self.g.add_edge(name, n.name, kind=ALIAS).name
                self.base_edge[st] = self.base_edge[into]
            elif st in self.base_edge:  # view or in-place result: no new memory
                self.value_edge[(n, i)] = self.g.add_edge(name, n.name, kind=ALIAS).name
            else:
                size = t.untyped_storage().nbytes()
                ekind = kind if self.g.nodes[n.name].resident else _EDGE_KIND.get(kind, ACTIVATION)
                edge = self.g.add_edge(name, n.name, size=size, kind=ekind).name
                self.base_edge[st] = self.value_edge[(n, i)] = edge
            self.value_storage[(n, i)] = st


def fx_to_dataflow(traced: TracedStep, eager_lifetimes: bool = True) -> DataflowGraph:
    """Turn a traced step into a DataflowGraph (see the module docstring for the rules).

    With `eager_lifetimes` (default) tensors live until PyTorch released them while tracing
    (`ReleaseWatch`), as when the step runs eagerly; without, until their last reader only."""
    return _DataflowBuilder(traced, eager_lifetimes).build()
