"""Import a training step (forward + loss + backward + optimizer) into a DataflowGraph.

First, `trace_training_step` / `trace_eval_step`: `make_fx` over a functional call of the
model, parameters and optimizer state as graph inputs, so the whole step is one aten graph in
PyTorch's own order (fake tensors by default: no memory or compute spent on big models).
Then `fx_to_dataflow`: one edge per allocation. Aliasing is read from the traced values'
storages (views and in-place results share their input's storage, so they become zero-size edges
and extend the base tensor's lifetime), `getitem` is folded into the multi-output producer, and
in-place writes get ordering edges (write after read, read after write) so that any order the
scheduler picks computes the same values.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode, make_fx
from torch.multiprocessing.reductions import StorageWeakRef

from analysis.memory.dataflow import (ACTIVATION, ALIAS, BACKWARD, CONSTANT, CONTROL, FORWARD,
                                      GRADIENT, INPUT, OPT_STATE, OPT_TEMP, OPTIMIZER, OUTPUT,
                                      WEIGHT, DataflowGraph)
from analysis.tensors import storage_key

_EDGE_KIND = {FORWARD: ACTIVATION, BACKWARD: GRADIENT, OPTIMIZER: OPT_TEMP, OUTPUT: ACTIVATION}


@dataclass
class TracedStep:
    """A traced step: the FX graph, the flat arguments it takes, and what each input is."""

    gm: torch.fx.GraphModule
    args: list[Any]
    input_kinds: list[str]                 # one per placeholder, in order
    phase_marks: dict[str, int] = field(default_factory=dict)  # phase -> first node index
    param_names: list[str] = field(default_factory=list)

    def phase_of(self, index: int) -> str:
        """Phase of the node at `index` in gm.graph.nodes (marks are graph lengths)."""
        phase = FORWARD
        for name in (BACKWARD, OPTIMIZER):
            if name in self.phase_marks and index >= self.phase_marks[name]:
                phase = name
        return phase


def default_loss(output: Any, target: Any = None) -> torch.Tensor:
    """Mean square of the model's main output: a cheap scalar that needs the full backward."""
    if hasattr(output, "last_hidden_state"):
        output = output.last_hidden_state
    elif isinstance(output, (tuple, list)):
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"default_loss: cannot find a tensor in model output {type(output)}")
    if target is not None:
        return torch.nn.functional.mse_loss(output, target)
    return output.float().square().mean()


def adam_update(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                state: Sequence[torch.Tensor], lr: float = 1e-3, betas=(0.9, 0.999),
                eps: float = 1e-8, step: int = 1) -> None:
    """In-place Adam, the same arithmetic as torch.optim.Adam(foreach=False) at `step`.

    `state` holds exp_avg and exp_avg_sq for each parameter, interleaved.
    """
    b1, b2 = betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is None:
            continue
        m, v = state[2 * i], state[2 * i + 1]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bc1)


def sgd_update(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
               state: Sequence[torch.Tensor], lr: float = 1e-2, momentum: float = 0.9) -> None:
    """In-place SGD with momentum (torch.optim.SGD after its first step); one buffer each."""
    for p, g, buf in zip(params, grads, state):
        if g is None:
            continue
        buf.mul_(momentum).add_(g)
        p.add_(buf, alpha=-lr)


_OPTIMIZERS: dict[str, tuple[Callable[..., None], int]] = {
    "adam": (adam_update, 2), "sgd": (sgd_update, 1)}


def _graph_len() -> int | None:
    mode = get_innermost_proxy_mode()
    return None if mode is None else len(mode.tracer.graph.nodes)


# Model inputs: positional (a sequence) or keyword (a mapping by forward parameter name, as the
# model zoo builds them); values that are not tensors (``attention_mask=None``, flags) are kept.
ModelInputs = Sequence[Any] | Mapping[str, Any]


def _split_inputs(inputs: ModelInputs) -> tuple[list[torch.Tensor], Callable[[list], tuple[tuple, dict]]]:
    """The tensors among ``inputs`` (they become graph inputs, in order) and how to rebuild the
    model's ``(args, kwargs)`` from them; anything else is a constant of the trace, so ``make_fx``
    never sees a ``None`` or a flag as an input."""
    keys = list(inputs) if isinstance(inputs, Mapping) else None
    values = list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)
    where = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]

    def rebuild(tensors: list) -> tuple[tuple, dict]:
        full = list(values)
        for i, t in zip(where, tensors):
            full[i] = t
        return ((), dict(zip(keys, full))) if keys is not None else (tuple(full), {})

    return [values[i] for i in where], rebuild


def trace_training_step(model: torch.nn.Module, inputs: ModelInputs,
                        target: torch.Tensor | None = None,
                        loss_fn: Callable[..., torch.Tensor] = default_loss,
                        optimizer: str = "adam", tracing_mode: str = "fake") -> TracedStep:
    """Trace forward, loss, backward and an in-place optimizer step as one FX graph.

    ``inputs``: the model's positional inputs, or its keyword inputs as a mapping."""
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; have {sorted(_OPTIMIZERS)}")
    update, n_state = _OPTIMIZERS[optimizer]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    buffers = dict(model.named_buffers())
    params = [p.detach().clone().requires_grad_(True) for _, p in named]
    state = [torch.zeros_like(p, requires_grad=False) for p in params for _ in range(n_state)]
    buf_vals = [b.detach().clone() for b in buffers.values()]
    inputs, rebuild = _split_inputs(inputs)
    marks: dict[str, int] = {}

    def step(params, state, buf_vals, inputs, *maybe_target):
        target = maybe_target[0] if maybe_target else None
        tensors = dict(zip(names, params))
        tensors.update(zip(buffers, buf_vals))
        out = torch.func.functional_call(model, tensors, *rebuild(inputs))
        loss = loss_fn(out, target) if target is not None else loss_fn(out)
        if (n := _graph_len()) is not None:
            marks[BACKWARD] = n
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        if (n := _graph_len()) is not None:
            marks[OPTIMIZER] = n
        with torch.no_grad():
            update(params, grads, state)
        return loss.detach()

    args = [params, state, buf_vals, inputs] + ([target] if target is not None else [])
    gm = make_fx(step, tracing_mode=tracing_mode)(*args)
    kinds = ([WEIGHT] * len(params) + [OPT_STATE] * len(state) + [WEIGHT] * len(buf_vals)
             + [INPUT] * (len(inputs) + (target is not None)))
    return TracedStep(gm, args, kinds, marks, names)


def trace_eval_step(model: torch.nn.Module, inputs: ModelInputs,
                    tracing_mode: str = "fake") -> TracedStep:
    """Trace an inference forward (no autograd) as one FX graph; weights are inputs."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(tensors)
    vals = [t.detach() for t in tensors.values()]
    inputs, rebuild = _split_inputs(inputs)

    def step(vals, inputs):
        with torch.no_grad():
            out = torch.func.functional_call(model, dict(zip(names, vals)), *rebuild(inputs))
        if hasattr(out, "last_hidden_state"):
            out = out.last_hidden_state
        return out

    gm = make_fx(step, tracing_mode=tracing_mode)(vals, inputs)
    return TracedStep(gm, [vals, inputs], [WEIGHT] * len(vals) + [INPUT] * len(inputs),
                      {}, names)


# ---- FX -> dataflow ---------------------------------------------------------------------
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

    def __init__(self, traced: TracedStep) -> None:
        self.traced = traced
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
            self._add_outputs(n, kind)
        self.g.validate()
        return self.g

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
            return [(src, idx)] if (src, idx) in self.value_edge else []
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

    def _add_outputs(self, n: torch.fx.Node, kind: str) -> None:
        for i, t in enumerate(_outputs_by_index(n.meta.get("val"))):
            if t is None:
                continue
            st = storage_key(t)
            name = f"{n.name}:{i}" if i else n.name
            if st in self.base_edge:  # view or in-place result: no new memory
                self.value_edge[(n, i)] = self.g.add_edge(name, n.name, kind=ALIAS).name
            else:
                size = t.untyped_storage().nbytes()
                ekind = kind if self.g.nodes[n.name].resident else _EDGE_KIND.get(kind, ACTIVATION)
                edge = self.g.add_edge(name, n.name, size=size, kind=ekind).name
                self.base_edge[st] = self.value_edge[(n, i)] = edge
            self.value_storage[(n, i)] = st


def fx_to_dataflow(traced: TracedStep) -> DataflowGraph:
    """Turn a traced step into a DataflowGraph (see the module docstring for the rules)."""
    return _DataflowBuilder(traced).build()


def import_training_step(model: torch.nn.Module, inputs: ModelInputs,
                         **kwargs: Any) -> tuple[DataflowGraph, TracedStep]:
    """Trace and import a training step; returns the graph and the trace it came from.

    ``inputs`` is positional (``[x]``) or keyword (``{"input_ids": ids, "attention_mask": None}``);
    ``kwargs`` go to `trace_training_step` (target, loss_fn, optimizer, tracing_mode)."""
    traced = trace_training_step(model, inputs, **kwargs)
    return fx_to_dataflow(traced), traced


def import_eval_step(model: torch.nn.Module, inputs: ModelInputs,
                     tracing_mode: str = "fake") -> tuple[DataflowGraph, TracedStep]:
    traced = trace_eval_step(model, inputs, tracing_mode=tracing_mode)
    return fx_to_dataflow(traced), traced
