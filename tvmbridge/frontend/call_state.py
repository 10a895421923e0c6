"""What a compiled call depends on besides its tensors: the module's state (parameters and
buffers, each tied tensor once, in input order; swapped for other tensors around a call) and
the autocast in effect."""

from __future__ import annotations

import contextlib
import copy
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .held_tensors import HeldSlot, HeldSwap, held_slots, read_slot, slot_name

PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_is_full_backward_hook",
        "_compiled_call_impl",
        "forward",
        "_tvm_dispatch",
        "remove_tvm_dispatch",
    }
)


def is_plain(value: Any) -> bool:
    """A value compared by equality: numbers, strings, dtypes, and short tuples/lists of them."""
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (tuple, list, frozenset)) and len(value) <= 64:
        return all(is_plain(v) for v in value)
    return False


# (module id, name) -> (label, value, plain, contents: a dict's, list's or set's own entries)
Attributes = dict[tuple[int, str], tuple[str, Any, bool, Any]]
MUTABLE = (dict, list, set)


def _contents(value: Any, plain: bool) -> Any:
    """A mutable container's entries as they are now (a shallow copy, compared by identity): a
    forward that fills a cache in place (``self.cache[key] = t``, LeViT's attention biases in
    eval mode) changes no attribute's identity; None for anything else."""
    if plain or not isinstance(value, MUTABLE):
        return None
    return list(value.items()) if isinstance(value, dict) else list(value)


def module_attributes(module: torch.nn.Module) -> Attributes:
    """Every attribute a forward may assign on every submodule (past nn.Module's own dicts):
    plain values copied (compared by value), others by identity (a tensor kept on the module)."""
    found: Attributes = {}
    for path, m in module.named_modules():
        for name, value in vars(m).items():
            if name not in MODULE_INTERNALS:
                plain = is_plain(value)
                found[(id(m), name)] = (
                    f"{path or type(m).__name__}.{name}",
                    copy.deepcopy(value) if plain else value,
                    plain,
                    _contents(value, plain),
                )
    return found


def _same(was: tuple[str, Any, bool, Any], now: tuple[str, Any, bool, Any]) -> bool:
    (_, old, plain, entries), new, now_entries = was, now[1], now[3]
    if entries is not None:
        return (
            old is new
            and len(entries) == len(now_entries)
            and all(_same_entry(a, b) for a, b in zip(entries, now_entries))
        )
    return old is new or (plain and type(old) is type(new) and old == new)


def _same_entry(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2:  # a dict's (key, value)
        return (a[0] is b[0] or (is_plain(a[0]) and a[0] == b[0])) and a[1] is b[1]
    return a is b


def changed_attributes(module: torch.nn.Module, before: Attributes) -> list[str]:
    """The labels of attributes assigned, added or deleted since ``before`` that a later call may
    read: plain values (a counter, a flag), public objects (``self.last = y``) and public
    dicts, lists and sets filled in place (a cache: ``self.cache[key] = t``). A private
    object (``_flat_weights``, which ``nn.LSTM`` rebuilds from its swapped weights) is a cache
    its module rebuilds itself: it is put back, not reported."""
    now = module_attributes(module)
    changed = []
    for key in before.keys() | now.keys():
        was, current = before.get(key), now.get(key)
        if was is not None and current is not None and _same(was, current):
            continue
        label, _, plain, _ = was or current  # type: ignore[misc]  # one of them is there
        if plain or (current is not None and current[2]) or not key[1].startswith("_"):
            changed.append(label)
    return sorted(changed)


_GONE = object()


def attribute_states(module: torch.nn.Module, labels: list[str]) -> tuple | None:
    """What the attributes :func:`changed_attributes` labelled hold now, to compare with another
    moment: plain values by value, containers by their type and keys (a cache emptied again
    reads as it did before it was filled), other objects by identity and version. None where a
    label names no attribute of a submodule (a hook a forward installed: unknown, not compared)."""
    modules = dict(module.named_modules())
    states: list[tuple] = []
    for label in labels:
        path, _, name = label.rpartition(".")
        owner = modules.get(path, module if path == type(module).__name__ else None)
        if owner is None or not name.isidentifier():  # not an attribute: a hook the call installed
            return None
        value = vars(owner).get(name, _GONE)
        if value is _GONE:
            states.append(("gone",))
        elif is_plain(value):
            states.append(("plain", type(value), repr(value)))
        elif isinstance(value, dict):
            states.append((type(value), tuple(map(repr, value))))
        elif isinstance(value, MUTABLE):
            states.append((type(value), len(value)))
        else:
            states.append(("object", id(value), getattr(value, "_version", None)))
    return tuple(states)


def restore_attributes(module: torch.nn.Module, before: Attributes) -> None:
    """Put back the attributes :func:`module_attributes` recorded (and drop ones added since)."""
    modules = {id(m): m for m in module.modules()}
    for key, m in modules.items():
        for name in [n for n in vars(m) if n not in MODULE_INTERNALS and (key, n) not in before]:
            delattr(m, name)
    for (owner, name), (_, value, plain, entries) in before.items():
        if owner in modules:
            object.__setattr__(modules[owner], name, copy.deepcopy(value) if plain else value)
            if entries is not None:  # filled in place: emptied and filled again as it was
                value.clear()
                if isinstance(value, dict):
                    value.update(entries)
                elif isinstance(value, list):
                    value.extend(entries)
                else:
                    value.update(entries)


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
    parameters, then buffers, then tensors held in public attributes (``held``: name -> slot, see
    :mod:`.held_tensors`; a leaf that requires grad counts as a parameter). ``aliases`` maps every
    other name of a tied tensor to its name here."""

    names: tuple[str, ...]
    is_parameter: tuple[bool, ...]
    aliases: dict[str, str]
    held: dict[str, HeldSlot] = field(default_factory=dict)

    @classmethod
    def of(cls, module: torch.nn.Module, device: torch.device | None = None, hold: bool = True) -> ModuleState:
        """``device``: the call's; a held tensor elsewhere stays a constant of the graph, as every
        held tensor does without ``hold``."""
        names: list[str] = []
        is_param: list[bool] = []
        seen: dict[int, str] = {}  # id of a tensor -> its first name
        aliases: dict[str, str] = {}
        held: dict[str, HeldSlot] = {}

        def add(name: str, t: torch.Tensor, kind: bool) -> None:
            if id(t) in seen:
                aliases[name] = seen[id(t)]
                return
            seen[id(t)] = name
            names.append(name)
            is_param.append(kind)

        for kind, items in (
            (True, module.named_parameters(remove_duplicate=False)),
            (False, module.named_buffers(remove_duplicate=False)),
        ):
            for name, t in items:
                add(name, t, kind)
        for slot, t in held_slots(module, device) if hold else ():
            held[slot_name(slot)] = slot
            add(slot_name(slot), t, t.requires_grad and t.is_leaf)  # a leaf that requires grad gets one
        return cls(tuple(names), tuple(is_param), aliases, held)

    def lookup(self, module: torch.nn.Module) -> list[torch.Tensor | None]:
        """The module's current tensor under each name (None where there is none any more)."""
        return [self.lookup_one(module, name, self.held.get(name)) for name in self.names]

    def tensors(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """:meth:`lookup` where every name has its tensor: the module the state was read from, as
        a compile reads it (a call checks the state first, ``runtime.guards``)."""
        found = self.lookup(module)
        missing = [name for name, t in zip(self.names, found) if t is None]
        assert not missing, f"the module has no tensor {missing} any more"
        return [t for t in found if t is not None]

    @staticmethod
    def lookup_one(module: torch.nn.Module, name: str, held: HeldSlot | None = None) -> torch.Tensor | None:
        """The parameter or buffer ``name``, or the tensor in the ``held`` slot."""
        if held is not None:
            return read_slot(module, held)
        owner, _, leaf = name.rpartition(".")
        try:
            sub = module.get_submodule(owner) if owner else module
        except AttributeError:
            return None
        return sub._parameters.get(leaf) if leaf in sub._parameters else sub._buffers.get(leaf)


class Swapped:
    """The slots :func:`swapped_state` filled: which the block assigned anew (``self.count =
    self.count + 1`` replaces a buffer rather than writing it)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, str], tuple[dict[str, Any], str, Any, str, Any]] = {}

    def reassigned(self) -> dict[str, torch.Tensor]:
        """State name -> the tensor now in a slot that no longer holds what was swapped in."""
        return {name: table[attr] for table, attr, _, name, put in self.slots.values() if table[attr] is not put}


@contextlib.contextmanager
def swapped_state(
    module: torch.nn.Module, state: dict[str, torch.Tensor], layout: ModuleState | None = None
) -> Iterator[Swapped]:
    """``module``'s parameters and buffers named in ``state`` replaced by those tensors for the
    block (at every path holding the same tensor: tied weights, a submodule registered twice),
    each restored once after; names the module lacks are ignored. ``torch.func.functional_call``
    with ``tie_weights`` restores a submodule registered under two paths (timm's CoaT shares its
    position encodings between blocks) to the tensor it swapped in, so a trace left the user's
    module holding fake tensors. What the block assigns to a slot is reported, then undone too.
    The tensors ``layout`` holds in attributes (``ModuleState.held``) are swapped as well (an
    alias of a parameter or buffer gets that tensor's value); what the block assigns to those stays."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    current = dict(named)
    paths_of: dict[int, list[str]] = {}
    for path, tensor in named:
        paths_of.setdefault(id(tensor), []).append(path)
    swapped = Swapped()
    for name, value in state.items():
        if name not in current:
            continue
        for path in paths_of[id(current[name])]:
            prefix, _, attr = path.rpartition(".")
            owner = module.get_submodule(prefix)
            table: dict[str, Any] = owner._parameters if attr in owner._parameters else owner._buffers
            if (id(owner), attr) not in swapped.slots:
                swapped.slots[(id(owner), attr)] = (table, attr, table[attr], name, value)
                table[attr] = value
    held = HeldSwap(module)
    for name, slot in (layout.held if layout is not None else {}).items():
        put = state.get(name, state.get(layout.aliases.get(name, "")))  # type: ignore[union-attr]
        if put is not None:
            held.put(slot, put)
    try:
        yield swapped
    finally:
        held.restore()
        for table, attr, original, _, _ in swapped.slots.values():
            table[attr] = original


def replace_buffer(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in the slot of buffer ``name`` and every other path holding the same tensor,
    as a forward that assigns the buffer anew leaves it (its shape may have changed)."""
    old = ModuleState.lookup_one(module, name)
    for path, tensor in module.named_buffers(remove_duplicate=False):
        if tensor is old:
            prefix, _, attr = path.rpartition(".")
            module.get_submodule(prefix)._buffers[attr] = value


# torch.nn.utils' old forward pre-hooks, which set a tensor attribute on every call, and the
# parametrizations that compute the same without assigning it
ASSIGNING_HOOKS = {
    "SpectralNorm": ("torch.nn.utils.spectral_norm", "torch.nn.utils.parametrizations.spectral_norm"),
    "WeightNorm": ("torch.nn.utils.weight_norm", "torch.nn.utils.parametrizations.weight_norm"),
}


def assigning_hooks(module: torch.nn.Module, labels: list[str]) -> str:
    """What to do where attributes in ``labels`` ("2.weight") are assigned by one of those
    hooks, or ``""``."""
    said = []
    for label in labels:
        owner_path, _, name = label.rpartition(".")
        try:
            owner = module.get_submodule(owner_path)
        except AttributeError:
            continue
        for hook in owner._forward_pre_hooks.values():
            if type(hook).__name__ in ASSIGNING_HOOKS and getattr(hook, "name", None) == name:
                old, new = ASSIGNING_HOOKS[type(hook).__name__]
                said.append(f"{label} is set on every call by {old}'s hook: use {new}, which compiles")
    return "; ".join(said)
