"""The traced callable: a module's call from flat tensors, the form ``torch.export`` takes.

The call's non-tensor leaves are bound as constants, the module's state comes in as inputs
(swapped in for the call), and what the forward showed beyond its graph is kept on the side
(``_Seen``): the output's structure, the buffers it assigned anew, the attributes it read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from .attribute_reads import ReadLog, recorded_reads
from .call_state import ModuleState, swapped_state
from .outputs import OutputLayout, flatten_output


class _Seen:
    """What tracing saw: the output's structure (shared, not copied, if the tracer copies the
    module)."""

    out_spec: OutputLayout | None = None
    reassigned: tuple[str, ...] = ()  # buffers the forward assigns anew (``self.n = self.n + 1``)

    def __init__(self) -> None:
        self.reads = ReadLog()  # the modules' attributes the forward read (``attribute_reads``)

    def __deepcopy__(self, memo: dict) -> _Seen:
        return self


class FlatCall(torch.nn.Module):
    """``inner`` called from flat tensors: the call's tensor leaves (the non-tensor leaves bound
    as constants), then the state tensors. Returns the output's leaves, then the new values of
    ``updated`` buffers, then of the ``updated_inputs`` (by position among the call's tensors;
    both updated on clones, so the export sees values, not mutations)."""

    inner: torch.nn.Module  # both set past nn.Module's __setattr__ (see __init__)
    seen: _Seen

    def __init__(
        self,
        inner: torch.nn.Module,
        in_spec: pytree.TreeSpec,
        leaves: list[Any],
        state: ModuleState,
        updated: tuple[str, ...] = (),
        updated_inputs: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a submodule: its state comes in as inputs
        self.in_spec = in_spec
        self.template = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self.slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.state = state
        self.updated = updated
        self.updated_inputs = updated_inputs
        object.__setattr__(self, "seen", _Seen())

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self.template)
        user = [t.clone() if j in self.updated_inputs else t for j, t in enumerate(tensors[: len(self.slots)])]
        for i, t in zip(self.slots, user):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        values = dict(zip(self.state.names, tensors[len(self.slots) :]))
        for name in self.updated:
            values[name] = values[name].clone()
        with swapped_state(self.inner, values, self.state) as swapped:
            # the forward, not the module's call: its own hooks run around each dispatched call, and
            # traced they would run twice (an output hook's change compiled in) or on fake tensors
            with recorded_reads(self.inner, self.seen.reads):
                out = self.inner.forward(*args, **kwargs)
            reassigned = swapped.reassigned()
        values.update(reassigned)
        self.seen.reassigned = tuple(sorted(reassigned))
        out_leaves, self.seen.out_spec = flatten_output(out)
        return (*out_leaves, *(values[n] for n in self.updated), *(user[j] for j in self.updated_inputs))
