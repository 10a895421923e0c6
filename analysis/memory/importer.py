"""Import a training step (forward + loss + backward + optimizer) into a DataflowGraph.

First, `trace_training_step` / `trace_eval_step`: `make_fx` over a functional call of the
model, parameters and optimizer state as graph inputs, so the whole step is one aten graph in
PyTorch's own order (fake tensors by default: no memory or compute spent on big models).
Then `fx_to_dataflow`: one edge per allocation. Aliasing is read from the traced values'
storages (views and in-place results share their input's storage, so they become zero-size edges
and extend the base tensor's lifetime), `getitem` is folded into the multi-output producer, and
in-place writes get ordering edges (write after read, read after write) so that any order the
scheduler picks computes the same values. Each allocation lives at least until PyTorch itself
released it while tracing (`ReleaseWatch`: autograd nodes hold saved tensors and formula
temporaries to their end), so the program order's simulated peak is the eager step's peak as
the allocator measures it (``allocator``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode, make_fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from analysis.memory.dataflow import (
    BACKWARD,
    FORWARD,
    INPUT,
    OPT_STATE,
    OPTIMIZER,
    WEIGHT,
    DataflowGraph,
)
from analysis.memory.fx_dataflow import fx_to_dataflow
from analysis.tensors import storage_key, tensor_leaves

TracingMode = Literal["real", "fake", "symbolic"]  # make_fx's


@dataclass
class TracedStep:
    """A traced step: the FX graph, the flat arguments it takes, and what each input is."""

    gm: torch.fx.GraphModule
    args: list[Any]
    input_kinds: list[str]  # one per placeholder, in order
    phase_marks: dict[str, int] = field(default_factory=dict)  # phase -> first node index
    param_names: list[str] = field(default_factory=list)
    # storage -> graph length when PyTorch dropped its last reference while tracing (None: held
    # until the step returned); see `ReleaseWatch`
    released: dict[StorageWeakRef, int | None] = field(default_factory=dict)
    # graph index of an autograd gradient sum -> storage of the gradient it adds to
    accumulations: dict[int, StorageWeakRef] = field(default_factory=dict)

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


def adam_update(
    params: Sequence[torch.Tensor],
    grads: list[torch.Tensor | None],
    state: Sequence[torch.Tensor],
    lr: float = 1e-3,
    betas=(0.9, 0.999),
    eps: float = 1e-8,
    step: int = 1,
) -> None:
    """In-place Adam, the same arithmetic as torch.optim.Adam(foreach=False) at `step`.

    `state` holds exp_avg and exp_avg_sq for each parameter, interleaved. Each gradient is
    dropped from `grads` and deleted right after its last use, and the denominator is a
    temporary of one expression, so run eagerly this frees memory where the traced graph does
    (at the last use), and an allocator measurement of it checks the simulator.
    """
    b1, b2 = betas
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    for i, p in enumerate(params):
        g, grads[i] = grads[i], None
        if g is None:
            continue
        m, v = state[2 * i], state[2 * i + 1]
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        del g
        p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)


def sgd_update(
    params: Sequence[torch.Tensor],
    grads: list[torch.Tensor | None],
    state: Sequence[torch.Tensor],
    lr: float = 1e-2,
    momentum: float = 0.9,
) -> None:
    """In-place SGD with momentum (torch.optim.SGD after its first step); one buffer each.
    Gradients are dropped once used, as in `adam_update`."""
    for i, (p, buf) in enumerate(zip(params, state)):
        g, grads[i] = grads[i], None
        if g is None:
            continue
        buf.mul_(momentum).add_(g)
        del g
        p.add_(buf, alpha=-lr)


_OPTIMIZERS: dict[str, tuple[Callable[..., None], int]] = {"adam": (adam_update, 2), "sgd": (sgd_update, 1)}


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


@dataclass
class StepProgram:
    """A training step as a plain Python function over flat arguments, before tracing: what
    `trace_training_step` traces, and what an allocator measurement runs eagerly (the same
    program, so the two peaks can be compared)."""

    fn: Callable[..., torch.Tensor]
    args: list[Any]
    input_kinds: list[str]
    param_names: list[str]
    phase_marks: dict[str, int] = field(default_factory=dict)  # filled while tracing


def training_step(
    model: torch.nn.Module,
    inputs: ModelInputs,
    target: torch.Tensor | None = None,
    loss_fn: Callable[..., torch.Tensor] = default_loss,
    optimizer: str = "adam",
) -> StepProgram:
    """Forward, loss, backward (``torch.autograd.grad``) and an in-place optimizer step as one
    function of (params, optimizer state, buffers, inputs[, target]); the arguments are copies."""
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
        del out  # as the traced graph does: autograd keeps what the backward needs
        if (n := _graph_len()) is not None:
            marks[BACKWARD] = n
        grads = list(torch.autograd.grad(loss, params, allow_unused=True))
        if (n := _graph_len()) is not None:
            marks[OPTIMIZER] = n
        with torch.no_grad():
            update(params, grads, state)
        return loss.detach()

    args = [params, state, buf_vals, inputs] + ([target] if target is not None else [])
    kinds = (
        [WEIGHT] * len(params)
        + [OPT_STATE] * len(state)
        + [WEIGHT] * len(buf_vals)
        + [INPUT] * (len(inputs) + (target is not None))
    )
    return StepProgram(step, args, kinds, names, marks)


class ReleaseWatch(TorchDispatchMode):
    """While make_fx traces, notes when PyTorch drops its last reference to each storage.

    The traced graph frees a tensor after its last reader; eager PyTorch frees it when nothing
    references it, which can be later: an autograd node keeps its saved tensors and incoming
    gradients until the whole node (its formula and the reduction of broadcast gradients) ran,
    a backward formula's C++ temporaries live to the end of their expression, a Python local
    until its function returns. Those are the temporaries a graph of single ops misses. Every
    op's tensor outputs get a finalizer; a storage is released when the last of them (views,
    the aliases autograd saves) is collected, at the graph length of that moment.

    It also notes the gradient sums of autograd's engine (`accumulations`: graph index of the
    ``add`` -> storage of the buffered gradient): an ``add`` that runs in a backward node after
    the node's post hooks, where the engine adds a new gradient to the one already buffered for
    the same input. Eagerly the engine adds in place when it holds the only reference to the
    buffered one; on fake tensors it never does (a tensor subclass), so the graph shows a new
    allocation there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.released: dict[StorageWeakRef, int | None] = {}
        self.accumulations: dict[int, StorageWeakRef] = {}
        self._live: dict[StorageWeakRef, int] = {}
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._finalizers: list[weakref.finalize] = []
        self._nodes: dict[Any, int] = {}  # autograd node -> number (cleared by close)
        self._applied: set[int] = set()  # nodes whose post hooks ran
        self.open = True

    def _autograd_node(self) -> int | None:
        """Number of the autograd node running now (its post hook registered on first sight)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return None
        if node not in self._nodes:
            k = self._nodes[node] = len(self._nodes)
            node.register_hook(lambda grad_in, grad_out, k=k: self._applied.add(k))
        return self._nodes[node]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = self._autograd_node() if self.open else None
        out = func(*args, **(kwargs or {}))
        if (
            node in self._applied
            and func is torch.ops.aten.add.Tensor
            and not kwargs
            and len(args) == 2
            and isinstance(args[0], torch.Tensor)
        ):
            self.accumulations[_graph_len() - 1] = storage_key(args[0])
        for t in tensor_leaves(out):
            if t not in self._seen:
                self._seen[t] = True
                key = storage_key(t)
                self._live[key] = self._live.get(key, 0) + 1
                self.released.pop(key, None)
                self._finalizers.append(weakref.finalize(t, self._drop, key))
        return out

    def _drop(self, key: StorageWeakRef) -> None:
        self._live[key] -= 1
        if self._live[key] == 0 and self.open:
            self.released[key] = _graph_len()

    def close(self) -> dict[StorageWeakRef, int | None]:
        """Stop watching; storages still referenced count as held until the step returned."""
        self.open = False
        self._nodes.clear()  # the hooks stay on the nodes but no longer reach them from here
        for key, n in self._live.items():
            if n > 0:
                self.released[key] = None
        for f in self._finalizers:
            f.detach()
        return self.released


def _trace(
    fn: Callable[..., Any], args: list[Any], tracing_mode: TracingMode
) -> tuple[torch.fx.GraphModule, ReleaseWatch]:
    """make_fx of ``fn`` with a `ReleaseWatch` inside (it records; the graph is unchanged)."""
    watch = ReleaseWatch()

    def watched(*a):
        with watch:
            return fn(*a)

    gm = make_fx(watched, tracing_mode=tracing_mode)(*args)
    watch.close()
    return gm, watch


def trace_training_step(
    model: torch.nn.Module,
    inputs: ModelInputs,
    target: torch.Tensor | None = None,
    loss_fn: Callable[..., torch.Tensor] = default_loss,
    optimizer: str = "adam",
    tracing_mode: TracingMode = "fake",
) -> TracedStep:
    """Trace forward, loss, backward and an in-place optimizer step as one FX graph.

    ``inputs``: the model's positional inputs, or its keyword inputs as a mapping."""
    prog = training_step(model, inputs, target, loss_fn, optimizer)
    gm, watch = _trace(prog.fn, prog.args, tracing_mode)
    return TracedStep(
        gm, prog.args, prog.input_kinds, prog.phase_marks, prog.param_names, watch.released, watch.accumulations
    )


def trace_eval_step(model: torch.nn.Module, inputs: ModelInputs, tracing_mode: TracingMode = "fake") -> TracedStep:
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

    gm, watch = _trace(step, [vals, inputs], tracing_mode)
    return TracedStep(
        gm, [vals, inputs], [WEIGHT] * len(vals) + [INPUT] * len(inputs), {}, names, watch.released, watch.accumulations
    )


def import_training_step(
    model: torch.nn.Module, inputs: ModelInputs, **kwargs: Any
) -> tuple[DataflowGraph, TracedStep]:
    """Trace and import a training step; returns the graph and the trace it came from.

    ``inputs`` is positional (``[x]``) or keyword (``{"input_ids": ids, "attention_mask": None}``);
    ``kwargs`` go to `trace_training_step` (target, loss_fn, optimizer, tracing_mode)."""
    traced = trace_training_step(model, inputs, **kwargs)
    return fx_to_dataflow(traced), traced


def import_eval_step(
    model: torch.nn.Module, inputs: ModelInputs, tracing_mode: TracingMode = "fake"
) -> tuple[DataflowGraph, TracedStep]:
    traced = trace_eval_step(model, inputs, tracing_mode=tracing_mode)
    return fx_to_dataflow(traced), traced
