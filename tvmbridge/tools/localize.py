"""Find the first op whose TVM value deviates from PyTorch's, for the double-precision checker.

The module is traced in eval mode in float64 (no randomness), converted with every intermediate
float tensor as an extra output, built for CPU and run; the traced graph runs in PyTorch with an
``fx.Interpreter`` that keeps every node's value. Walking the graph in order, the first value
whose relative error is above the tolerance is where the conversion goes wrong: earlier values
agree, so its inputs were right.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind

from .. import names
from ..backend.build import compile_module, load
from ..devices import target_for
from ..frontend.export import trace
from ..frontend.importer import to_relax
from ..frontend.signature import canonical_call
from ..options import CompileOptions
from ..passes import DecomposeForTraining
from ..runtime.dispatch import dispatcher_of
from ..runtime.function import to_torch, to_tvm


class _Recorder(torch.fx.Interpreter):
    """Runs the graph and keeps every node's value."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy running the module's own forward (a TVM dispatch on it removed from the copy)."""
    m = copy.deepcopy(module)
    if getattr(m, "_tvm_dispatch", None) is not None:
        dispatcher_of(m).remove()  # the copy's dispatcher, as m.remove_tvm_dispatch would call
    return m


def _graph_inputs(ep: Any, user: list[torch.Tensor]) -> list[torch.Tensor]:
    """The exported graph's placeholders in order: lifted constants and the call's tensors."""
    it = iter(user)
    return [
        ep.constants[s.target] if s.kind == InputKind.CONSTANT_TENSOR else next(it)
        for s in ep.graph_signature.input_specs
    ]


def describe_node(node: torch.fx.Node, frames: int = 2) -> str:
    """``aten op (node)`` and the innermost source frames that made it (file:line, code). The
    module path is not in the trace: the export runs the module through ``functional_call``."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    found = []
    for i, line in enumerate(lines[:-1]):
        text = line.strip()
        if text.startswith("File ") and "/torch/" not in text:
            parts = text.split('"')
            where = f"{parts[1].rsplit('/', 1)[-1]}:{text.split('line ')[-1].split(',')[0]}" if len(parts) > 1 else text
            found.append(f"{where} `{lines[i + 1].strip()}`")
    source = " <- ".join(reversed(found[-frames:]))
    return f"{node.target} (node {node.name})" + (f" at {source}" if source else "")


def first_deviation(
    module: torch.nn.Module, args: tuple, kwargs: dict, tolerance: float, options: CompileOptions
) -> str | None:
    """The first op (graph order) whose float64 value in TVM deviates from PyTorch's, else None."""
    m = plain_copy(module).double().eval()
    cast = lambda x: x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    args, kwargs = tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
    traced = trace(m, args, kwargs, stack_traces=True)  # names the deviating op's source line
    converted = to_relax(traced, options.converters, probe=True)
    leaves = pytree.tree_leaves(canonical_call(m.forward, args, kwargs))
    user = [x for x in leaves if isinstance(x, torch.Tensor)] + [t.detach() for t in traced.state.tensors(m)]
    device = torch.device("cpu")
    mod = DecomposeForTraining()(converted.mod)  # TVM's layer_norm kernel is float32/16 only
    vm = load(compile_module(mod, target_for(device, options.fp_contract)), device)
    result = vm[names.MAIN](*[to_tvm(t) for t in user])
    probed = [to_torch(r) for r in list(result)[-len(converted.probes) :]] if converted.probes else []
    recorder = _Recorder(traced.exported.graph_module)
    with torch.no_grad():
        recorder.run(*_graph_inputs(traced.exported, user))
    nodes = {n.name: n for n in traced.exported.graph.nodes}
    for name, got in zip(converted.probes, probed):
        want = recorder.values.get(name)
        if not isinstance(want, torch.Tensor) or want.shape != got.shape or not want.numel():
            continue
        err = (got.double() - want.double()).abs().max().item()
        scale = max(want.double().abs().max().item(), 1e-300)
        if err / scale > tolerance or err != err:  # NaN counts
            return describe_node(nodes[name]) + f": relative error {err / scale:.2e}"
    return None
