"""What a compiled call depends on besides its tensors: the module's state (parameters and
buffers, each tied tensor once, in input order; swapped for other tensors around a call) and
the autocast in effect."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AutocastState:
    """An enabled ``torch.autocast`` on one device type: tracing under it records its casts as
    ops of the graph, so the graph fits calls made under the same state only."""

    device_type: str
    dtype: torch.dtype

    @classmethod
    def current(cls, device_type: str) -> AutocastState | None:
        """The autocast in effect for ``device_type`` now (None: off)."""
        if not torch.is_autocast_enabled(device_type):
            return None
        return cls(device_type, torch.get_autocast_dtype(device_type))

    @staticmethod
    def entered(state: AutocastState | None, device_type: str) -> torch.autocast:
        """A context that puts ``state`` (None: autocast off) in effect for ``device_type``."""
        if state is None:
            return torch.autocast(device_type, enabled=False)
        return torch.autocast(state.device_type, dtype=state.dtype)

    def __str__(self) -> str:
        return f"autocast({self.device_type}, {str(self.dtype).removeprefix('torch.')})"


@dataclass(frozen=True)
class ModuleState:
    """The tensors of a module that a compiled call reads, each tied tensor once, in input order:
    parameters, then buffers. ``aliases`` maps every other name of a tied tensor to its name here."""

    names: tuple[str, ...]
    is_parameter: tuple[bool, ...]
    aliases: dict[str, str]

    @classmethod
    def of(cls, module: torch.nn.Module) -> ModuleState:
        names: list[str] = []
        is_param: list[bool] = []
        seen: dict[int, str] = {}  # id of a tensor -> its first name
        aliases: dict[str, str] = {}
        for kind, items in (
            (True, module.named_parameters(remove_duplicate=False)),
            (False, module.named_buffers(remove_duplicate=False)),
        ):
            for name, t in items:
                if id(t) in seen:
                    aliases[name] = seen[id(t)]
                    continue
                seen[id(t)] = name
                names.append(name)
                is_param.append(kind)
        return cls(tuple(names), tuple(is_param), aliases)

    def lookup(self, module: torch.nn.Module) -> list[torch.Tensor | None]:
        """The module's current tensor under each name (None where there is none any more)."""
        return [self.lookup_one(module, name) for name in self.names]

    def tensors(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """:meth:`lookup` where every name has its tensor: the module the state was read from, as
        a compile reads it (a call checks the state first, ``runtime.guards``)."""
        found = self.lookup(module)
        missing = [name for name, t in zip(self.names, found) if t is None]
        assert not missing, f"the module has no tensor {missing} any more"
        return [t for t in found if t is not None]

    @staticmethod
    def lookup_one(module: torch.nn.Module, name: str) -> torch.Tensor | None:
        owner, _, leaf = name.rpartition(".")
        try:
            sub = module.get_submodule(owner) if owner else module
        except AttributeError:
            return None
        return sub._parameters.get(leaf) if leaf in sub._parameters else sub._buffers.get(leaf)


@contextlib.contextmanager
def swapped_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters and buffers named in ``state`` replaced by those tensors for the
    block (at every path holding the same tensor: tied weights, a submodule registered twice),
    each restored once after; names the module lacks are ignored. ``torch.func.functional_call``
    with ``tie_weights`` restores a submodule registered under two paths (timm's CoaT shares its
    position encodings between blocks) to the tensor it swapped in, so a trace left the user's
    module holding fake tensors."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    current = dict(named)
    paths_of: dict[int, list[str]] = {}
    for path, tensor in named:
        paths_of.setdefault(id(tensor), []).append(path)
    slots: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = {}
    for name, value in state.items():
        if name not in current:
            continue
        for path in paths_of[id(current[name])]:
            prefix, _, attr = path.rpartition(".")
            owner = module.get_submodule(prefix)
            table: dict[str, Any] = owner._parameters if attr in owner._parameters else owner._buffers
            if (id(owner), attr) not in slots:
                slots[(id(owner), attr)] = (table, attr, table[attr])
                table[attr] = value
    try:
        yield
    finally:
        for table, attr, original in slots.values():
            table[attr] = original
