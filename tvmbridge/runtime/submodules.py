"""Compile by submodules: a module that cannot compile as a whole has its submodules compiled by themselves.

Under ``fallback=True`` a module whose forward the bridge cannot take (a Python branch on a random
draw, as transformers' LayerDrop; an op with no converter; a tensor hook set inside forward) keeps
PyTorch for its own code, and each submodule it calls is dispatched by itself: compiled on its
first call and checked against PyTorch then, as every variant is. A model with one untraceable
line then trains on TVM everywhere else, as ``torch.compile`` breaks a graph around what it cannot
take. A submodule that fails in turn is split the same way.

Which submodules: containers without a forward of their own (``ModuleList``, ``ModuleDict``) are
looked through; submodules without parameters are left to PyTorch (nothing to learn in them, and a
compile costs seconds); a submodule already dispatched by the user is left as it is; a submodule
reached twice (shared) is dispatched once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import AttributeWriteError, ConversionError

if TYPE_CHECKING:
    from ..options import CompileOptions

MAX_NAMED = 6  # submodules named in a message; the rest are counted


def splits_into_submodules(module: torch.nn.Module, options: CompileOptions, exc: ConversionError) -> bool:
    """Whether a compile failure of ``module`` is one its submodules may compile past: a failure of
    the module's code, not of the call's arguments (stage ``inputs``) or of attributes the forward
    assigns (traced again later), and not a graph ``torch.compile`` handed over (the backend
    splits those at the failing ops itself)."""
    return (
        options.fallback
        and options.compile_submodules
        and not isinstance(exc, AttributeWriteError)
        and exc.stage != "inputs"
        and not isinstance(module, torch.fx.GraphModule)
    )


def _candidates(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The submodules to dispatch by themselves, by their path from ``module``."""
    found: list[tuple[str, torch.nn.Module]] = []
    seen = {id(module)}

    def visit(prefix: str, parent: torch.nn.Module) -> None:
        for name, child in parent.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}{name}"
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):  # no forward: what they hold
                visit(f"{path}.", child)
            elif next(child.parameters(), None) is not None:
                found.append((path, child))

    visit("", module)
    return found


def dispatch_submodules(module: torch.nn.Module, options: CompileOptions, owner: str) -> list[str]:
    """Dispatch ``module``'s submodules by themselves (compiled lazily, on their first call); the
    paths of those so dispatched, the ones dispatched before for it included. A submodule the user
    dispatched stays the user's."""
    from .dispatch import add_tvm_dispatch, dispatcher_or_none

    parts = []
    for path, child in _candidates(module):
        dispatcher = dispatcher_or_none(child)
        if dispatcher is None:
            add_tvm_dispatch(child, options=options)
            dispatcher = dispatcher_or_none(child)
            assert dispatcher is not None  # no sample: nothing compiled, nothing can fail
            dispatcher.submodule_of = owner
        if dispatcher.submodule_of is not None:
            parts.append(path)
    return parts


def remove_submodule_dispatch(module: torch.nn.Module) -> None:
    """Undo :func:`dispatch_submodules` for every submodule below ``module`` (theirs included)."""
    from .dispatch import dispatcher_or_none, remove_tvm_dispatch

    for child in list(module.modules())[1:]:
        dispatcher = dispatcher_or_none(child)
        if dispatcher is not None and dispatcher.submodule_of is not None:
            remove_tvm_dispatch(child)


def describe_submodules(parts: list[str]) -> str:
    """The paths for a message: the first few by name, the rest counted."""
    named = ", ".join(parts[:MAX_NAMED])
    more = f" and {len(parts) - MAX_NAMED} more" if len(parts) > MAX_NAMED else ""
    return f"{named}{more}"


def submodules_report(module: torch.nn.Module, paths: list[str]) -> str:
    """For ``explain()``: per submodule dispatched by itself, its calls on TVM and in PyTorch."""
    from .dispatch import dispatcher_or_none

    lines = []
    for path in paths:
        dispatcher = dispatcher_or_none(module.get_submodule(path))
        if dispatcher is not None:
            lines.append(
                f"  submodule {path}: {len(dispatcher.variants)} variant(s), {dispatcher.calls_tvm} calls compiled, "
                f"{dispatcher.calls_fallback} PyTorch"
            )
    return "\nsubmodules dispatched by themselves (its own code runs PyTorch):\n" + "\n".join(lines) if lines else ""
