"""Checks of settings the trace compiles in: plain values, containers of them, and objects that
hold them (a config object, a namespace of arguments), however deep the forward reached.

A value a forward read while tracing is a constant of the compiled code. A plain value is
compared by equality; a dict, list, tuple or set of plain values, nested, is compared as a deep
copy (up to ``TREE_BUDGET`` values: an entry set in place shows); an object of fields is checked
by identity, and each of its fields the same way, ``OBJECT_DEPTH`` objects deep
(``self.config.text_config.scale``, ``ARGS.model.width``); a tensor (a constant to the trace) by
identity and version, so a write in place shows. Code and namespaces (classes,
functions, modules) are not values. Used by the module's side of the guard (``state_guard``)
and by the globals' (``global_reads``).
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch

from ..frontend.call_state import is_plain

Check = tuple[str, dict, str, Any, bool, Any]  # label, holder, key, expected, by identity, contents
TREE_BUDGET = 256  # plain values in one dict/list/tuple/set compared at every call, at most
OBJECT_DEPTH = 3  # objects followed through their fields
CONTAINERS = (dict, list, tuple, set, frozenset)
NOT_VALUES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.nn.Module)


def is_plain_tree(value: Any, budget: int = TREE_BUDGET) -> bool:
    """Plain values in dicts, lists, tuples and sets, nested, at most ``budget`` of them."""
    todo, count = [value], 0
    while todo:
        item = todo.pop()
        if type(item) in CONTAINERS:
            todo += [x for kv in item.items() for x in kv] if isinstance(item, dict) else list(item)
        elif not is_plain(item):
            return False
        count += 1
        if count > budget:
            return False
    return True


def fields_of(value: Any) -> dict | None:
    """The fields of an object that holds settings, or None (code, namespaces, tensors, builtins)."""
    fields = getattr(value, "__dict__", None)
    if isinstance(value, NOT_VALUES) or type(fields) is not dict:
        return None
    return fields


def _tensor_check(label: str, holder: dict, name: str) -> Check:
    """A tensor the trace compiled in as a constant: the same one, unwritten (its version)."""
    value = holder[name]
    return (label, holder, name, value, True, (value._version,))


def field_checks(
    label: str, fields: dict, private: bool = False, depth: int = OBJECT_DEPTH, note: str = ""
) -> list[Check]:
    """The checks of an object's fields: plain ones and trees by value, objects by identity and
    then their own fields (public ones: a private field is the object's own cache), ``depth``
    objects deep. ``private``: this object's private fields too. ``note`` ends each label."""
    checks: list[Check] = []
    for name, value in fields.items():
        if not private and isinstance(name, str) and name.startswith("_"):
            continue
        if is_plain(value) or is_plain_tree(value):
            checks.append((f"{label}.{name}{note}", fields, name, copy.deepcopy(value), False, None))
        elif isinstance(value, torch.Tensor):
            checks.append(_tensor_check(f"{label}.{name}{note}", fields, name))
        elif depth > 1 and (inner := fields_of(value)) is not None:
            checks.append((f"{label}.{name}{note}", fields, name, value, True, None))
            checks += field_checks(f"{label}.{name}", inner, depth=depth - 1, note=note)
    return checks


def value_checks(label: str, holder: dict, name: str, note: str = "") -> list[Check]:
    """The checks of ``holder[name]``: by value, or by identity and field by field; none for
    anything else. ``note`` ends each label (who read it)."""
    value = holder[name]
    if is_plain(value) or is_plain_tree(value):
        return [(label + note, holder, name, copy.deepcopy(value), False, None)]
    if isinstance(value, torch.Tensor):
        return [_tensor_check(label + note, holder, name)]
    fields = fields_of(value)
    if fields is None:
        return []
    return [(label + note, holder, name, value, True, None), *field_checks(label, fields, note=note)]
