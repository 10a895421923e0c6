"""Hooks on a dispatched module's submodules, which compiled code does not run.

A hook on a submodule runs while the bridge traces: what it returns is compiled in, but what it
does besides (keep the activation in a list, count calls, log a statistic) happens once, on the
trace's fake tensors, and never on a compiled call: a feature extractor's list held one fake
tensor and stayed so. The hooks on the dispatched module itself run around every call, as always.

Two kinds are exceptions. transformers' output-capturing hooks (``output_hidden_states=True``)
act only on a collector the model's own forward sets for its call, so what they do is in the trace
(the hidden states are outputs) and, in a call that asks for nothing, they do nothing. And a
forward hook whose whole code is ``output.requires_grad_(...)`` (transformers'
``enable_input_require_grads``, which gradient checkpointing and PEFT install on the input
embeddings) only asks autograd to track an intermediate value: compiled code computes the
gradients of everything that requires one through it regardless.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from .call_state import ASSIGNING_HOOKS

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)
_CALL_SCOPED_MODULES = frozenset({"transformers.utils.output_capturing"})
_MARKING_OPS = frozenset(  # what ``output.requires_grad_(True)`` compiles to, and nothing else
    {"LOAD_FAST", "LOAD_METHOD", "LOAD_ATTR", "LOAD_CONST", "CALL", "POP_TOP", "RETURN_VALUE", "RETURN_CONST"}
)


def marks_output_for_grad(hook: Callable[..., Any]) -> bool:
    """A plain function whose only statement is ``<its last argument>.requires_grad_(<constant>)``:
    read off its bytecode (no other name, no closure, no global, no nested code). The guards ask
    on every call: the reading is kept per code object."""
    return isinstance(hook, types.FunctionType) and _only_marks_output(hook.__code__)


@functools.lru_cache(maxsize=256)
def _only_marks_output(code: types.CodeType) -> bool:
    if code.co_freevars or code.co_names != ("requires_grad_",) or code.co_argcount < 3:
        return False
    if any(isinstance(c, types.CodeType) for c in code.co_consts):
        return False
    output = code.co_varnames[code.co_argcount - 1]
    steps = [i for i in dis.get_instructions(code) if i.opname not in ("RESUME", "PRECALL", "CACHE", "NOP")]
    loads = [i for i, ins in enumerate(steps) if ins.opname in ("LOAD_METHOD", "LOAD_ATTR")]
    return (
        bool(loads)
        and all(k > 0 and steps[k - 1].opname == "LOAD_FAST" and steps[k - 1].argval == output for k in loads)
        and all(ins.opname in _MARKING_OPS for ins in steps)
    )


def call_scoped(hook: Callable[..., Any]) -> bool:
    """A hook whose whole effect is on the call it runs in (see the module's docstring)."""
    return getattr(hook, "__module__", None) in _CALL_SCOPED_MODULES or marks_output_for_grad(hook)


def _kind(dict_name: str) -> str:
    """``_forward_pre_hooks`` -> ``forward pre hooks``."""
    return dict_name.strip("_").replace("_", " ")


def counted(hooks: Mapping[int, Callable[..., Any]]) -> int:
    """The hooks of one dict that compiled code would miss."""
    return sum(1 for h in hooks.values() if not call_scoped(h)) if hooks else 0


def _assigns_every_call(hook: Any) -> bool:
    """The old ``nn.utils.spectral_norm``/``weight_norm`` hooks: they set the module's weight on
    every call, which the trace refuses with the parametrization to use instead."""
    return type(hook).__name__ in ASSIGNING_HOOKS


def submodule_hooks(module: torch.nn.Module) -> list[str]:
    """``fc: 1 forward hook``: the hooks compiled code would miss, by submodule; process-wide
    module hooks (``register_module_forward_hook``) too, as they run on every submodule."""
    found = []
    for path, m in module.named_modules():
        if not path:
            continue
        for name in HOOK_DICTS:
            hooks = {k: h for k, h in getattr(m, name).items() if not _assigns_every_call(h)}
            if n := counted(hooks):
                found.append(f"{path}: {n} {_kind(name)[:-1]}")
    for name in GLOBAL_HOOK_DICTS:
        if n := counted(getattr(nn_module, name)):
            found.append(f"every module: {n} {_kind(name).removeprefix('global ')[:-1]}")
    return found


def hooks_refusal(module: torch.nn.Module) -> str | None:
    """Why ``module`` cannot be traced for compiled calls, if hooks on its submodules would be
    missed, and what to do."""
    found = submodule_hooks(module)
    if not found:
        return None
    name = type(module).__name__
    shown = "; ".join(found[:3]) + ("; ..." if len(found) > 3 else "")
    return (
        f"hooks on {name}'s submodules ({shown}), which compiled code does not run: they would run once, "
        f"on the trace's fake tensors, and never on a compiled call. Register them on {name} itself (its "
        "own hooks run around every call), dispatch the submodules without hooks instead, or pass "
        "fallback=True: PyTorch then runs this module's own code and its submodules compile by themselves, "
        "each with its hooks run around its calls"
    )


HookSnapshot = list[tuple[str, dict, dict]]  # (label, the module's hook dict, its entries before)


def hook_snapshot(module: torch.nn.Module) -> HookSnapshot:
    """Every hook dict of every submodule, as it is now (see :func:`restore_hooks`)."""
    return [
        (f"{path or type(m).__name__} {_kind(name)}", hooks, dict(hooks))
        for path, m in module.named_modules()
        for name in HOOK_DICTS
        if isinstance(hooks := getattr(m, name), dict)
    ]


def restore_hooks(snapshot: HookSnapshot) -> list[str]:
    """The hooks registered or removed since ``snapshot`` (a forward that installs hooks on first
    use: transformers' output capturing), put back in place (the dicts stay the same objects); the
    labels of those that changed. A trace that left its hooks would have them run twice after."""
    changed = []
    for label, hooks, before in snapshot:
        if hooks.keys() != before.keys():
            hooks.clear()
            hooks.update(before)
            changed.append(label)
    return changed
