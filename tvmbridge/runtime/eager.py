"""The module's own forward while it is dispatched: what a fallback runs, what the first-call check
compares against, and what a double backward differentiates.

It is the class's ``forward`` bound at each call, or a ``forward`` the user set on the instance
before dispatching. While PyTorch's forward runs for the bridge (:meth:`EagerForward.call`),
calls that reach the dispatcher again on this thread run it too (``active``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..frontend.call_state import AutocastState, swapped_state
from ..frontend.outputs import flatten_output
from .locks import TRACING

if TYPE_CHECKING:
    from .compiled import CompiledModule


class EagerForward:
    """The original forward of one module."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.forward_fn = type(module).forward  # the class's forward, bound at each call
        self.instance_forward: Any = module.__dict__.get("forward")  # a forward set on the instance
        self.local = threading.local()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.local = threading.local()

    @property
    def bound(self) -> Any:
        """The forward as the user's code sees it (its signature, name and docstring)."""
        return self.instance_forward if self.instance_forward is not None else self.forward_fn.__get__(self.module)

    @property
    def active(self) -> bool:
        """This thread is running PyTorch's forward for the bridge (a nested call runs it too)."""
        return getattr(self.local, "active", False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.instance_forward is not None:
            return self.instance_forward(*args, **kwargs)
        return self.forward_fn(self.module, *args, **kwargs)

    def reinstall(self) -> None:
        """The module's forward as it was before dispatch."""
        if self.instance_forward is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.instance_forward

    def outputs(self, compiled: CompiledModule, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """PyTorch's forward on the given call and state tensors: the flat outputs, as the
        compiled code returns them (for a double backward)."""
        return flatten_output(self.call(compiled, tensors)[0])[0]

    def call(
        self, compiled: CompiledModule, tensors: list[torch.Tensor], full_precision: bool = False
    ) -> tuple[Any, list[torch.Tensor]]:
        """PyTorch's forward on the given call and state tensors: its output, and the new values
        of the buffers and inputs it updates, in the compiled outputs' order (updated on clones,
        so they are not updated twice). ``full_precision``: the safety net's reference, with
        autocast off whatever the variant was traced under, and float32 tensors (the call's and
        the module's) widened to float64 where no autocast was on."""
        traced = compiled.traced
        if full_precision and traced.autocast is None:
            tensors = [t.double() if t.dtype == torch.float32 else t for t in tensors]
        user = [t.clone() if i in traced.updated_inputs else t for i, t in enumerate(tensors[: traced.num_user_inputs])]
        pending = iter(user)
        leaves = [
            traced.constant_leaves[i] if i in traced.constant_leaves else next(pending)
            for i in range(traced.in_spec.num_leaves)
        ]
        args, kwargs = pytree.tree_unflatten(leaves, traced.in_spec)
        state = dict(zip(traced.state.names, tensors[traced.num_user_inputs :]))
        state.update({n: state[n].clone() for n in traced.updated_buffers})
        self.local.active = True
        try:  # under the autocast the variant was traced under, whatever is in effect now; the module's
            # tensors swapped for these meanwhile; its forward alone (its own hooks run around this call)
            with (
                TRACING.writing(),
                AutocastState.entered(None if full_precision else traced.autocast, compiled.device.type),
                swapped_state(self.module, state, traced.state) as swapped,
            ):
                out = self(*args, **kwargs)
                state.update(swapped.reassigned())
        finally:
            self.local.active = False
        return out, [state[n] for n in traced.updated_buffers] + [user[i] for i in traced.updated_inputs]


def update_targets(compiled: CompiledModule, tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors a call writes in place, named, in the compiled outputs' order."""
    traced = compiled.traced
    by_name = dict(zip(traced.state.names, tensors[traced.num_user_inputs :]))
    return [(f"buffer {n}", by_name[n]) for n in traced.updated_buffers] + [
        (f"input {i}", tensors[i]) for i in traced.updated_inputs
    ]
