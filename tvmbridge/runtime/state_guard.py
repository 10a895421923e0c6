"""The module's side of a variant's guard: its state layout (parameters and buffers, tied how,
with what shape, dtype, device and ``requires_grad``), the attributes of each submodule that the
trace read (``p``, ``eps``, ``training``, a config object's fields, nested: ``frontend.attribute_reads``
says which, ``value_checks`` how), the globals and class attributes its forward read
(``global_reads``), the names each module has, its submodules and the hooks present. Checked at
every call: thousands of attributes on a whole model, so first in a few passes in C
(:class:`BatchedChecks`), and attribute by attribute only to say what differs."""

from __future__ import annotations

import copy
from collections import OrderedDict
from itertools import chain, repeat
from types import MappingProxyType
from typing import Any, cast

import torch
from torch.nn.modules import module as nn_module

from ..frontend.attribute_reads import AttributeReads
from ..frontend.call_state import MODULE_INTERNALS, ModuleState, is_plain
from ..frontend.held_tensors import NO_KEY, HeldSlot, owner_of, read_in, slot_name
from ..frontend.module_hooks import GLOBAL_HOOK_DICTS, HOOK_DICTS, counted
from .global_reads import global_checks
from .guards import Mismatch, describe_tensor_difference, short_value, tensor_key
from .value_checks import Check, field_checks, fields_of, is_plain_tree

_MISSING = object()


def _module_checks(
    path: str,
    m: torch.nn.Module,
    held: dict[str, frozenset],
    state: frozenset[int] = frozenset(),
    read: frozenset[str] | None = None,
) -> list[Check]:
    """``(label, dict holding the value, key, expected value, compare by identity, contents)``
    for every attribute of ``m`` that the compiled code may depend on; ``contents``: what
    :func:`_contents` gives for it now (None: nothing inside to check). ``held``: attributes whose
    tensor, or whose entries under those keys, are inputs of the call (their shapes are checked
    with the state's, :meth:`StateGuard.tensors`), not compiled in. ``state``: the ids of the
    module's parameters and buffers, inputs of the call wherever they are held (``nn.LSTM``'s
    ``_flat_weights`` lists its own parameters): an entry that is one of them is checked by
    identity, not by version (an optimizer step writes them all). ``read``: the names the trace
    read on ``m`` (``frontend.attribute_reads``; None: all): an attribute never read is not
    checked (a step counter the loop keeps on the model)."""
    label = path or type(m).__name__
    checks: list[Check] = []
    internals = _internals(path)
    for name, value in vars(m).items():
        if name in internals or isinstance(value, torch.nn.Module) or not _was_read(name, read):
            continue
        if is_plain(value) or _plain_entries(value) or is_plain_tree(value):  # a copy: an edit in place must show
            checks.append((f"{label}.{name}", vars(m), name, copy.deepcopy(value), False, None))
            continue
        if name in held and isinstance(value, torch.Tensor):
            continue
        keys = held.get(name, frozenset())
        checks.append((f"{label}.{name}", vars(m), name, value, True, _contents(value, keys, state)))
        if name == "forward":  # a submodule's own forward (a dispatched one counts its calls): by identity
            continue
        if (fields := fields_of(value)) is not None:  # a config object's fields, and its objects'
            checks += field_checks(f"{label}.{name}", fields, private=True)
    for name, child in m._modules.items():
        checks.append((f"{label}.{name} (the submodule)", m._modules, name, child, True, None))
    return checks


Layout = tuple[str, str, dict, frozenset]  # owner's label, what it names, the dict, its names when compiled


def _was_read(name: str, read: frozenset[str] | None) -> bool:
    return read is None or name in read or name in ALWAYS_CHECKED


ALWAYS_CHECKED = frozenset({"training"})  # the bridge's own code reads it around the trace


class _KnownUnlessRead(frozenset):
    """A module's attribute names when compiled, and every name the trace did not look up: an
    attribute added since is a change only if forward read that name (and found it missing)."""

    read: frozenset[str] = frozenset()

    def __contains__(self, name: object) -> bool:
        return frozenset.__contains__(self, name) or name not in self.read


def _module_layouts(path: str, m: torch.nn.Module, read: frozenset[str] | None = None) -> list[Layout]:
    """The dicts of names ``m``'s forward looks things up in: its attributes, submodules,
    parameters and buffers, and its config objects' fields. A name added there since compiling
    (a layer appended to a ``ModuleList``, ``self.scale = 2.0`` where forward has
    ``getattr(self, "scale", None)``) is a change the compiled code did not see. ``read``: the
    attribute names the trace looked up on ``m`` (None: all): only those can be added ones."""
    label = path or type(m).__name__
    layouts = [
        (label, "an attribute", vars(m)),
        (label, "a submodule", m._modules),
        (label, "a parameter", m._parameters),
        (label, "a buffer", m._buffers),
    ]
    for name, value in vars(m).items():
        fields = getattr(value, "__dict__", None)
        if name not in MODULE_INTERNALS and not isinstance(value, torch.nn.Module) and type(fields) is dict:
            layouts.append((f"{label}.{name}", "a field", fields))
    internals = _internals(path)  # names that may come and go: taken as known
    found: list[Layout] = []
    for owner, kind, h in layouts:
        if type(h) not in _DICTS:
            continue
        known = frozenset(h) | (internals if kind == "an attribute" else frozenset())
        if kind == "an attribute" and read is not None:
            known = _KnownUnlessRead(known)
            known.read = read
        found.append((owner, kind, h, known))
    return found


def _internals(path: str) -> frozenset[str]:
    """torch's and the bridge's own names in a module's ``__dict__``: not what forward reads.
    ``add_tvm_dispatch`` sets the dispatched module's ``forward`` after compiling; a submodule's
    ``forward`` set on the instance is the user's, and what a call runs."""
    return MODULE_INTERNALS if not path else MODULE_INTERNALS - {"forward"}


def _added(layout: Layout) -> str | None:
    """A name in the dict that it did not have when compiled. Not counted among attributes and
    fields: a private name (``_code``, which an FX graph module sets on first use)."""
    _, kind, holder, known = layout
    public = kind not in ("an attribute", "a field")
    return next(
        (k for k in holder if k not in known and (public or not _private(k)) and not _dispatched_forward(holder, k)),
        None,
    )


def _dispatched_forward(holder: dict, name: Any) -> bool:
    """A submodule's ``forward`` that ``add_tvm_dispatch`` set (the user's, or one a failed compile
    set by ``runtime/submodules.py``): it runs the same forward, on TVM or as PyTorch, so the
    compiled code, which traced that forward, still holds."""
    from .dispatch import Dispatcher  # a dispatch's module guards with this one

    return name == "forward" and isinstance(holder[name], Dispatcher)


def _private(name: Any) -> bool:
    return isinstance(name, str) and name.startswith("_")


CONTAINERS = (dict, list, tuple, set, frozenset)


def _plain_entries(value: Any) -> bool:
    """A dict or set of plain values only (a model's config dict): compared as a copy, by equality."""
    if isinstance(value, dict) and type(value) in (dict, OrderedDict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return type(value) in (set, frozenset, list) and all(is_plain(v) for v in value)


class HeldContents(tuple):
    """:func:`_contents` of a container some of whose entries are inputs: those under the ``held``
    keys, and the module's parameters and buffers (``state``: their ids)."""

    held: frozenset = frozenset()
    state: frozenset = frozenset()


_INPUT = "<an input>"
_NONE: frozenset = frozenset()


def _contents(value: Any, held: frozenset = frozenset(), state: frozenset = frozenset()) -> tuple | None:
    """What the trace read inside a tensor or a container that is no parameter or buffer: a
    tensor's version, a dict's, list's, tuple's or set's entries by identity and the versions of
    the tensors among them. The trace bakes such a tensor into the compiled code as a constant
    (one that cannot be an input: on another device, in a private attribute), so a later change
    (reassigned, written in place, an entry replaced) must not fit the variant. Entries under
    the ``held`` keys are inputs of the call: any tensor there fits (``read_in`` reads it). An
    entry whose id is in ``state`` is a parameter or buffer: an input, compared by identity only."""
    if isinstance(value, torch.Tensor):
        return (value._version,)
    if isinstance(value, dict):
        entries: Any = [x for k, v in value.items() for x in (k, _INPUT if k in held else v)]
    elif isinstance(value, (list, tuple)) and held:
        entries = [_INPUT if i in held else v for i, v in enumerate(value)]
    elif isinstance(value, CONTAINERS):
        entries = value
    else:
        return None
    if state and state.isdisjoint(map(id, entries)):
        state = _NONE  # no parameter among the entries: a plain tuple, rechecked without a marker
    found = tuple(
        x if is_plain(x) else (id(x), x._version) if isinstance(x, torch.Tensor) and id(x) not in state else (id(x),)
        for x in entries
    )
    if not held and not state:
        return found
    marked = HeldContents(found)
    marked.held, marked.state = held, state
    return marked


def _same(value: Any, expected: Any, by_identity: bool) -> bool:
    if value is expected:
        return True
    return not by_identity and type(value) is type(expected) and _equal(value, expected)


def _equal(value: Any, expected: Any) -> bool:
    """``value == expected``, where a tensor put into a container since compiling makes the
    comparison ambiguous (an error): not equal."""
    try:
        return bool(value == expected)
    except (RuntimeError, TypeError, ValueError):
        return False


_DICTS = (dict, OrderedDict)  # read with ``dict.get`` in C: no Python-level ``get`` of theirs to honour


class BatchedChecks:
    """The state guard's checks as a few passes in C (``map`` over the holders): whether every
    attribute is as compiled, without a Python loop step per attribute (a whole model has
    thousands). Only answers yes or no; the guard's own loop says what differs."""

    def __init__(
        self,
        checks: list[Check],
        hooks: list[tuple[str, dict, int]],
        layouts: list[Layout],
        classes: list[tuple[str, torch.nn.Module, type]],
    ) -> None:
        self.modules, self.classes = [c[1] for c in classes], [c[2] for c in classes]
        self.layouts = layouts
        self.layout_holders = [layout[2] for layout in layouts]
        self.layout_sizes = list(map(len, self.layout_holders))
        fast = [c for c in checks if type(c[1]) in _DICTS and c[5] is None]
        plain = [c for c in fast if not c[4]]
        same = [c for c in fast if c[4]]
        self.plain_holders, self.plain_keys = [c[1] for c in plain], [c[2] for c in plain]
        self.plain_values, self.plain_types = [c[3] for c in plain], [type(c[3]) for c in plain]
        self.same_holders, self.same_keys = [c[1] for c in same], [c[2] for c in same]
        self.same_ids = [id(c[3]) for c in same]  # the expected objects stay alive in the checks
        # a class's methods the trace called, by identity in its namespace (a read-only proxy)
        methods = [c for c in checks if type(c[1]) is MappingProxyType and c[4] and c[5] is None]
        self.method_holders, self.method_keys = [c[1] for c in methods], [c[2] for c in methods]
        self.method_ids = [id(c[3]) for c in methods]
        self.rest = [
            c
            for c in checks
            if (type(c[1]) not in _DICTS or c[5] is not None) and not (type(c[1]) is MappingProxyType and c[4])
        ]
        self.hookless = [h for _, h, n in hooks if n == 0 and not h]  # a hook there would be missed
        self.hooked = [c for c in hooks if c[2] != 0 or c[1]]  # counted (call-scoped ones do not count)

    def fit(self) -> bool:
        if list(map(len, self.layout_holders)) != self.layout_sizes and not self._settled_layouts():
            return False
        if list(map(type, self.modules)) != self.classes:
            return False
        values = list(map(dict.get, self.plain_holders, self.plain_keys, repeat(_MISSING)))
        if list(map(type, values)) != self.plain_types or not _equal(values, self.plain_values):
            return False
        found = map(dict.get, self.same_holders, self.same_keys, repeat(_MISSING))
        if list(map(id, found)) != self.same_ids or (any(self.hookless) and not self._settled_hooks()):
            return False
        methods = map(MappingProxyType.get, self.method_holders, self.method_keys, repeat(_MISSING))  # type: ignore[arg-type]
        if list(map(id, methods)) != self.method_ids:
            return False
        return not any(_differs(c) for c in self.rest) and all(counted(h) == n for _, h, n in self.hooked)

    def _settled_hooks(self) -> bool:
        """False where a hook compiled code would miss came; else a dict that now holds only
        call-scoped hooks (transformers' output capturing, installed by a later call) is counted
        from now on, instead of sending every call down the per-attribute loop."""
        if any(counted(h) for h in self.hookless):
            return False
        self.hooked += [("", h, 0) for h in self.hookless if h]
        self.hookless = [h for h in self.hookless if not h]
        return True

    def _settled_layouts(self) -> bool:
        """False where a dict of names gained one; else the sizes are taken as they are now (only
        module internals came, or a name went, which its own check sees)."""
        for i, layout in enumerate(self.layouts):
            if len(layout[2]) != self.layout_sizes[i]:
                if _added(layout) is not None:
                    return False
                self.layout_sizes[i] = len(layout[2])
        return True


def _differs(check: Check) -> bool:
    _, holder, name, expected, by_identity, contents = check
    value = holder.get(name, _MISSING)
    if contents is not None and isinstance(expected, CONTAINERS):  # another dict of the same entries fits
        return type(value) is not type(expected) or _recheck(value, contents) != contents
    return not _same(value, expected, by_identity) or (contents is not None and _recheck(value, contents) != contents)


def _recheck(value: Any, contents: tuple) -> tuple | None:
    """:func:`_contents` of ``value`` now, with the inputs ``contents`` was taken with."""
    return _contents(value, getattr(contents, "held", _NONE), getattr(contents, "state", _NONE))


def _emptied(value: Any, contents: tuple) -> bool:
    """Whether the container now holds only some of the entries it had when compiled."""
    if type(value) in _DICTS:
        return set(value) < set(contents[0::2])  # a dict's contents: key, entry, key, entry, ...
    return type(value) is list and len(value) < len(contents)


def _mismatch(check: Check) -> Mismatch:
    """What differs in a check that :func:`_differs` failed."""
    label, holder, name, expected, by_identity, contents = check
    value = holder.get(name, _MISSING)
    if contents is not None and isinstance(expected, CONTAINERS):
        held = getattr(contents, "held", _NONE)
        if held and _emptied(value, contents):
            return Mismatch(label, f"{label} was emptied (compiled with its tensors as inputs)", emptied=True)
        return Mismatch(label, f"{label} holds other entries than compiled for (or one was written to)")
    if _same(value, expected, by_identity):
        return Mismatch(label, f"{label} was changed in place since compiling (an entry, or a tensor's values)")
    if not by_identity:
        return Mismatch(
            label,
            f"{label} is {'gone' if value is _MISSING else short_value(value)}, compiled for {short_value(expected)}",
        )
    kind = type(expected).__name__
    shown = f"gone (compiled with a {kind})" if value is _MISSING else f"another {kind} than compiled for"
    return Mismatch(label, f"{label} is {shown}")


def _owner(module: torch.nn.Module, slot: HeldSlot) -> torch.nn.Module:
    owner = owner_of(module, slot[0])
    assert owner is not None, f"no module {slot[0]} (the state was read from this module)"
    return owner


def _held_by_owner(module: torch.nn.Module, state: ModuleState) -> dict[int, dict[str, frozenset]]:
    """id of a module -> its attributes holding inputs -> the keys of those entries (none: the
    attribute is the tensor)."""
    found: dict[int, dict[str, set]] = {}
    for slot in state.held.values():
        keys = found.setdefault(id(_owner(module, slot)), {}).setdefault(slot[1], set())
        if slot[2] is not NO_KEY:
            keys.add(slot[2])
    return {i: {attr: frozenset(keys) for attr, keys in attrs.items()} for i, attrs in found.items()}


class StateGuard:
    """The module's state layout and tensor metadata, attributes, submodules and hooks.

    :meth:`check` runs first: once it passed, the submodules are the compiled ones, so
    :meth:`tensors` reads each parameter and buffer straight from its owner's dict."""

    def __init__(
        self,
        module: torch.nn.Module,
        state: ModuleState,
        with_grad: set[int],
        computed: frozenset[int] = frozenset(),
        reads: AttributeReads | None = None,
    ) -> None:
        self.state = state
        self.keys = [tensor_key(t) for t in state.tensors(module)]
        self.with_grad = with_grad  # state positions the compiled backward computes a gradient for
        self.checks: list[Check] = []
        self.hooks: list[tuple[str, dict, int]] = []
        self.layouts: list[Layout] = []
        self.classes: list[tuple[str, torch.nn.Module, type]] = []  # ``__class__`` swapped: another forward
        held = _held_by_owner(module, state)
        inputs = frozenset(map(id, chain(module.parameters(), module.buffers())))
        forwards: set[tuple] = set()  # forwards and class attributes checked already
        for path, m in module.named_modules(remove_duplicate=False):
            self.classes.append((path or type(m).__name__, m, type(m)))
            read = reads.get(id(m)) if reads is not None else None
            self.checks += _module_checks(path, m, held.get(id(m), {}), inputs, read)
            self.checks += global_checks(m, forwards, read)
            self.layouts += _module_layouts(path, m, read)
            if path:  # the module's own hooks run around the dispatched forward, as always
                self.hooks += [(f"{path} {h}", getattr(m, h), counted(getattr(m, h))) for h in HOOK_DICTS]
        self.hooks += [(h, getattr(nn_module, h), counted(getattr(nn_module, h))) for h in GLOBAL_HOOK_DICTS]
        owned = [name for name in state.names if name not in state.held]
        self.slots = [self._slot(module, name) for name in owned]
        # tensors in attributes: after the parameters and buffers (``ModuleState.of``), read from
        # their owner's ``__dict__`` through the attribute (a cache dict is replaced, not emptied)
        self.held_slots = [(vars(_owner(module, state.held[n])), state.held[n]) for n in state.names[len(owned) :]]
        self.alias_slots = [
            (self._slot(module, alias), state.names.index(name))
            for alias, name in state.aliases.items()
            if alias not in state.held
        ]
        # held tensors passed as data: all but those the backward computes a gradient for (a graph behind them)
        self.detached = [
            j for j in range(len(owned), len(state.names)) if not state.is_parameter[j] and j not in computed
        ]
        self.held_alias_slots = [
            (vars(_owner(module, state.held[alias])), state.held[alias], state.names.index(name))
            for alias, name in state.aliases.items()
            if alias in state.held
        ]
        self.batched = BatchedChecks(self.checks, self.hooks, self.layouts, self.classes)

    @staticmethod
    def _slot(module: torch.nn.Module, name: str) -> tuple[dict, str]:
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        return (sub._parameters if leaf in sub._parameters else sub._buffers), leaf

    def check(self, module: torch.nn.Module) -> Mismatch | None:
        return None if self.batched.fit() else self.difference()

    def difference(self) -> Mismatch | None:
        """The first check that fails, with what differs (the per-attribute loop)."""
        for check in self.checks:
            if _differs(check):
                return _mismatch(check)
        for label, m, cls in self.classes:
            if type(m) is not cls:
                return Mismatch(label, f"{label} is now a {type(m).__name__}, compiled for a {cls.__name__}")
        for layout in self.layouts:
            if (name := _added(layout)) is not None:
                label = f"{layout[0]}.{name}"
                return Mismatch(
                    label, f"{label} ({layout[1]}) was added since compiling (the compiled code never read it)"
                )
        for label, hooks, n in self.hooks:
            if counted(hooks) != n:
                return Mismatch(
                    label,
                    f"{label}: {counted(hooks)} registered, compiled with {n} (hooks do not run inside compiled code)",
                    recompile=False,
                )
        return None

    def tensors(self, module: torch.nn.Module) -> tuple[list[torch.Tensor] | None, Mismatch | None]:
        """The state tensors for this call, or why there are none that fit (after :meth:`check`)."""
        tensors = [holder.get(leaf) for holder, leaf in self.slots]
        if self.held_slots:
            tensors += [read_in(owner, slot) for owner, slot in self.held_slots]
        for j, (t, (shape, dtype, device)) in enumerate(zip(tensors, self.keys)):
            name = self.state.names[j]
            if t is None:
                kind = "a tensor in that attribute" if name in self.state.held else "a parameter or buffer"
                return None, Mismatch(f"{name} gone", f"{name} is no longer {kind}")
            if t.shape != shape or t.dtype != dtype or t.device != device:
                return None, describe_tensor_difference(name, t, (shape, dtype, device))
            if t.requires_grad and j not in self.with_grad:
                return None, Mismatch(f"{name} requires_grad", f"{name} requires grad, compiled without its gradient")
        for (holder, leaf), j in self.alias_slots:
            if holder.get(leaf) is not tensors[j]:
                name = self.state.names[j]
                alias = next(a for a, n in self.state.aliases.items() if n == name)
                return None, Mismatch(f"{alias} tie", f"{alias} is no longer tied to {name}")
        for owner, slot, j in self.held_alias_slots:
            if read_in(owner, slot) is not tensors[j]:
                name = self.state.names[j]
                return None, Mismatch(f"{slot_name(slot)} tie", f"{slot_name(slot)} is no longer {name}")
        for j in self.detached:  # held, no gradient computed for it (a stored loss no output reads): as data
            if tensors[j].requires_grad:  # type: ignore[union-attr]  # none is None (checked above)
                tensors[j] = tensors[j].detach()  # type: ignore[union-attr]
        return cast(list[torch.Tensor], tensors), None  # none is None (checked above)
