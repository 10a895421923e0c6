"""Import a training step (forward + loss + backward + optimizer) into a DataflowGraph.

Stage 1, `trace_training_step` / `trace_eval_step`: `make_fx` over a functional call of the
model, parameters and optimizer state as graph inputs, so the whole step is one aten graph in
PyTorch's own order (fake tensors by default: no memory or compute spent on big models).
Stage 2, `fx_to_dataflow`: one edge per allocation. Aliasing is read from the traced values'
storages (views and in-place results share their input's storage, so they become zero-size edges
and extend the base tensor's lifetime), `getitem` is folded into the multi-output producer, and
in-place writes get ordering edges (write after read, read after write) so that any order the
scheduler picks computes the same values.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode, make_fx

from analysis.dataflow import (ACTIVATION, ALIAS, BACKWARD, CONSTANT, CONTROL, FORWARD,
                               GRADIENT, INPUT, OPT_STATE, OPT_TEMP, OPTIMIZER, OUTPUT,
                               WEIGHT, DataflowGraph)

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


def trace_training_step(model: torch.nn.Module, inputs: Sequence[torch.Tensor],
                        target: torch.Tensor | None = None,
                        loss_fn: Callable[..., torch.Tensor] = default_loss,
                        optimizer: str = "adam", tracing_mode: str = "fake") -> TracedStep:
    """Trace forward, loss, backward and an in-place optimizer step as one FX graph."""
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; have {sorted(_OPTIMIZERS)}")
    update, n_state = _OPTIMIZERS[optimizer]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    buffers = dict(model.named_buffers())
    params = [p.detach().clone().requires_grad_(True) for _, p in named]
    state = [torch.zeros_like(p, requires_grad=False) for p in params for _ in range(n_state)]
    buf_vals = [b.detach().clone() for b in buffers.values()]
    inputs = list(inputs)
    marks: dict[str, int] = {}

    def step(params, state, buf_vals, inputs, *maybe_target):
        target = maybe_target[0] if maybe_target else None
        tensors = dict(zip(names, params))
        tensors.update(zip(buffers, buf_vals))
        out = torch.func.functional_call(model, tensors, tuple(inputs))
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


def trace_eval_step(model: torch.nn.Module, inputs: Sequence[torch.Tensor],
                    tracing_mode: str = "fake") -> TracedStep:
    """Trace an inference forward (no autograd) as one FX graph; weights are inputs."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = list(tensors)
    vals = [t.detach() for t in tensors.values()]
    inputs = list(inputs)

    def step(vals, inputs):
        with torch.no_grad():
            out = torch.func.functional_call(model, dict(zip(names, vals)), tuple(inputs))
        if hasattr(out, "last_hidden_state"):
            out = out.last_hidden_state
        return out

    gm = make_fx(step, tracing_mode=tracing_mode)(vals, inputs)
    return TracedStep(gm, [vals, inputs], [WEIGHT] * len(vals) + [INPUT] * len(inputs),
                      {}, names)


# ---- FX -> dataflow ---------------------------------------------------------------------
def _tensors(val: Any) -> list[torch.Tensor | None]:
    """Outputs of an FX node's value, by output index (non-tensors as None)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


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


def fx_to_dataflow(traced: TracedStep) -> DataflowGraph:
    """Turn a traced step into a DataflowGraph (see the module docstring for the rules)."""
    gm = traced.gm
    g = DataflowGraph()
    value_edge: dict[tuple[torch.fx.Node, int], str] = {}   # (fx node, output) -> data edge
    value_storage: dict[tuple[torch.fx.Node, int], int] = {}
    base_edge: dict[int, str] = {}                          # storage -> allocation edge
    last_writer: dict[int, str] = {}
    readers: dict[int, set[str]] = {}
    ctrl: dict[str, str] = {}
    placeholder_i = 0

    def control(src: str, dst: str) -> None:
        if src == dst:
            return
        if src not in ctrl:
            ctrl[src] = g.add_edge(f"{src}:ctrl", src, kind=CONTROL).name
        g.add_sink(ctrl[src], dst)

    def resolve(a: torch.fx.Node) -> list[tuple[torch.fx.Node, int]]:
        """Fold getitem: the (producer, output index) pairs a node argument stands for."""
        if a.op == "call_function" and a.target is operator.getitem:
            src, idx = a.args[0], a.args[1]
            return [(src, idx)] if (src, idx) in value_edge else []
        return [(a, i) for i in range(len(_tensors(a.meta.get("val")))) if (a, i) in value_edge]

    for index, n in enumerate(gm.graph.nodes):
        if n.op == "call_function" and n.target is operator.getitem:
            continue
        if n.op in ("placeholder", "get_attr"):
            kind = traced.input_kinds[placeholder_i] if n.op == "placeholder" else CONSTANT
            placeholder_i += n.op == "placeholder"
            if not n.users:
                continue  # parameters nothing uses are dropped
        elif n.op == "output":
            kind = OUTPUT
        else:
            kind = traced.phase_of(index)
        g.add_node(n.name, kind, str(n.target) if n.op != "placeholder" else "placeholder")

        reads: list[tuple[torch.fx.Node, int]] = []
        for a in n.all_input_nodes:
            reads.extend(resolve(a))
        for key in reads:
            g.add_sink(value_edge[key], n.name)
            st = value_storage[key]
            g.add_sink(base_edge[st], n.name)
            if st in last_writer:
                control(last_writer[st], n.name)  # read after write
            readers.setdefault(st, set()).add(n.name)

        for w in _written_args(n):
            for key in resolve(w) if isinstance(w, torch.fx.Node) else []:
                st = value_storage[key]
                for r in readers.get(st, ()):      # write after read
                    control(r, n.name)
                if st in last_writer:
                    control(last_writer[st], n.name)
                last_writer[st] = n.name
                readers[st] = set()

        if n.op == "output":
            for key in reads:
                g.edges[base_edge[value_storage[key]]].is_output = True
            continue
        for i, t in enumerate(_tensors(n.meta.get("val"))):
            if t is None:
                continue
            st = _storage_key(t)
            name = f"{n.name}:{i}" if i else n.name
            if st in base_edge:            # view or in-place result: no new memory
                value_edge[(n, i)] = g.add_edge(name, n.name, kind=ALIAS).name
            else:
                size = t.untyped_storage().nbytes()
                ekind = kind if g.nodes[n.name].resident else _EDGE_KIND.get(kind, ACTIVATION)
                base_edge[st] = value_edge[(n, i)] = g.add_edge(name, n.name, size=size,
                                                                kind=ekind).name
            value_storage[(n, i)] = st
    g.validate()
    return g


def import_training_step(model: torch.nn.Module, inputs: Sequence[torch.Tensor],
                         **kwargs: Any) -> tuple[DataflowGraph, TracedStep]:
    """Trace and import a training step; returns the graph and the trace it came from."""
    traced = trace_training_step(model, inputs, **kwargs)
    return fx_to_dataflow(traced), traced


def import_eval_step(model: torch.nn.Module, inputs: Sequence[torch.Tensor],
                     tracing_mode: str = "fake") -> tuple[DataflowGraph, TracedStep]:
    traced = trace_eval_step(model, inputs, tracing_mode=tracing_mode)
    return fx_to_dataflow(traced), traced
