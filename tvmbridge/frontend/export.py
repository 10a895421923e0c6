"""Trace one call of a module with ``torch.export``, decomposed to core ATen.

The call is first put in canonical form (``signature``); its non-tensor leaves are bound as
constants (:class:`FlatCall`), so the exported program takes tensors only. What the export learned
(the call's structure, the constants it specialised on, the order of inputs and parameters) is
kept in :class:`TracedModule` for the guard and the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from ..errors import ConversionError, describe
from .signature import canonical_call


@dataclass(frozen=True)
class TracedModule:
    """What tracing learned about a module and one call signature."""

    exported: ExportedProgram
    in_spec: pytree.TreeSpec  # of the canonical (args, kwargs)
    out_spec: pytree.TreeSpec
    constant_leaves: dict[int, Any]  # leaf index -> the non-tensor value the export specialised on
    user_input_names: list[str]  # tensor placeholders in Relax parameter order
    param_targets: list[str]  # module parameter names in Relax parameter order
    num_outputs: int


class FlatCall(torch.nn.Module):
    """Calls ``inner`` from the tensor leaves of one call signature, the non-tensor leaves bound as
    constants, so that the exported program has tensors only as user inputs."""

    def __init__(self, inner: torch.nn.Module, in_spec: pytree.TreeSpec, leaves: list[Any]) -> None:
        super().__init__()
        self.inner = inner
        self.in_spec = in_spec
        self.template = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self.slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.template)
        for i, t in zip(self.slots, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return self.inner(*args, **kwargs)


def trace(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> TracedModule:
    """Export ``module`` for one call and decompose to core ATen (the form that is converted)."""
    call_args, call_kwargs = canonical_call(module.forward, args, kwargs)
    leaves, in_spec = pytree.tree_flatten((call_args, call_kwargs))
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
    try:
        ep = torch.export.export(FlatCall(module, in_spec, leaves), args=tensors, strict=False)
        ep = ep.run_decompositions()
    except Exception as exc:  # noqa: BLE001 - torch raises many types here
        raise ConversionError(
            "trace", f"torch.export could not trace {type(module).__name__}: {describe(exc)}"
        ) from exc
    _check_state_is_not_mutated(ep)
    num_outputs = _check_outputs(ep)
    user_inputs = _user_input_names(ep)
    if len(user_inputs) != len(tensors):
        raise ConversionError(
            "trace", f"expected {len(tensors)} tensor inputs in the export, found {len(user_inputs)}"
        )
    params = [
        s.target.removeprefix("inner.") for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER
    ]
    return TracedModule(
        exported=ep, in_spec=in_spec, out_spec=ep.call_spec.out_spec,
        constant_leaves={i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)},
        user_input_names=user_inputs, param_targets=params, num_outputs=num_outputs,
    )


def _check_state_is_not_mutated(ep: ExportedProgram) -> None:
    bad = [s for s in ep.graph_signature.output_specs if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)]
    if bad:
        raise ConversionError(
            "trace",
            "the module mutates state during forward "
            f"({', '.join(f'{s.kind.name} {s.target}' for s in bad)}), e.g. BatchNorm running "
            "statistics in train mode; only functional modules can be compiled",
        )


def _check_outputs(ep: ExportedProgram) -> int:
    """The number of outputs, all of which must be tensors."""
    out_nodes = list(ep.graph.find_nodes(op="output"))[0].args[0]
    for o in out_nodes:
        if not isinstance(o, torch.fx.Node) or not isinstance(o.meta.get("val"), torch.Tensor):
            raise ConversionError(
                "trace", f"output {o!r} is not a tensor; only (nested tuples of) tensors can be "
                "returned by a compiled module"
            )
    return len(out_nodes)


def _user_input_names(ep: ExportedProgram) -> list[str]:
    values = {n.name: n.meta.get("val") for n in ep.graph.find_nodes(op="placeholder")}
    return [
        s.arg.name for s in ep.graph_signature.input_specs
        if s.kind == InputKind.USER_INPUT and isinstance(values.get(getattr(s.arg, "name", None)), torch.Tensor)
    ]

