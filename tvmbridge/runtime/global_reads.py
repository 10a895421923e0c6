"""Plain module-level and class-level values a forward reads, which the trace compiles in as constants.

``return self.lin(x) * SCALE`` with ``SCALE`` a global of the model's file: the trace reads 2.0 and
the compiled code multiplies by 2.0 for good; a training script that sets ``model_file.SCALE = 3.0``
later (a temperature schedule, a debug flag) got the old value with no sign. The state guard checks
these as it checks the module's own plain attributes: each name the ``forward`` of the module and
of every submodule loads (its code, and the code of functions and comprehensions defined in it)
that resolves, in that forward's globals, to a plain value (numbers, strings, short tuples of them)
is compared with its traced value at every call; another value compiles another variant.

The same for class attributes (``scale = 2.0`` in the class body, read as ``self.scale`` and set
later as ``MyModel.scale = 3.0``): a name the forward loads that the instance does not hold and its
class (or a base) holds as a plain value is checked in that class's namespace.

Beyond single values (``value_checks``): a dict, list, tuple or set of plain values, nested
(``CONFIG["shift"]["on"]``), compared as a deep copy, so an entry set in place shows; an object
holding settings (an ``argparse.Namespace`` of the script's arguments, a dataclass or
``SimpleNamespace`` config: ``ARGS.temperature``) by identity, and its public fields the same way.

Functions of the forward's own file that it calls are followed (a few calls deep): ``scaled(h)``
reading ``SCALE`` counts. Library functions (another file) are not followed, methods called on
other objects are not. Functions, classes and modules in globals are code, checked by identity
(a helper patched after compiling), as are the methods the trace called on a module's class.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Iterator
from typing import cast

import torch

from ..frontend.call_state import is_plain
from .value_checks import Check, is_plain_tree, value_checks

FOLLOW_DEPTH = 3  # calls followed from a forward into functions of its own file


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _forward_function(module: torch.nn.Module) -> types.FunctionType | None:
    forward = inspect.unwrap(type(module).forward)
    return forward if isinstance(forward, types.FunctionType) else None


def _global_reads(forward: types.FunctionType) -> dict[tuple[int, str], tuple[dict, str]]:
    """``(id(globals), name) -> (globals, reader)`` for each name the forward's code loads, and the
    code of the functions of its own file it calls (to ``FOLLOW_DEPTH`` calls deep)."""
    found: dict[tuple[int, str], tuple[dict, str]] = {}
    todo, visited = [(forward, 0)], set()
    while todo:
        function, depth = todo.pop()
        if id(function.__code__) in visited:
            continue
        visited.add(id(function.__code__))
        space = function.__globals__
        for name in (n for code in _codes(function.__code__) for n in code.co_names):
            found.setdefault((id(space), name), (space, function.__qualname__))
            value = space.get(name)
            if (
                isinstance(value, types.FunctionType)
                and value.__module__ == forward.__module__
                and depth < FOLLOW_DEPTH
            ):
                todo.append((inspect.unwrap(value), depth + 1))  # a function of the forward's own file
    return found


def global_checks(module: torch.nn.Module, seen: set[tuple], read: frozenset[str] | None = None) -> list[Check]:
    """Checks of the plain globals ``module``'s forward reads (none for a forward and class in
    ``seen``: a class used many times is checked once) and of the plain class attributes it
    reads: the names its forward's code loads, and ``read``, what the trace looked up on this
    instance (``frontend.attribute_reads``: in a helper method too), each class's once."""
    forward = _forward_function(module)
    if forward is None:
        return []
    checks: list[Check] = []
    if (id(forward.__code__), type(module)) not in seen:
        seen.add((id(forward.__code__), type(module)))
        for key, (space, reader) in _global_reads(forward).items():
            name = key[1]
            if name in space and not name.startswith("__") and key not in seen:
                seen.add(key)  # one check per global, whichever forwards read it
                found = value_checks(f"global {name}", space, name, f" (read by {reader})")
                # else code or an object: the same one (a helper function patched in a library's module)
                checks += found or [(f"global {name} (read by {reader})", space, name, space[name], True, None)]
    where = f"{type(module).__name__}'s forward"
    loaded = dict.fromkeys(n for code in _codes(forward.__code__) for n in code.co_names)
    for name in [*loaded, *sorted(read or ())]:
        owner = next((c for c in type(module).__mro__ if name in vars(c)), None)
        if owner is None or owner is torch.nn.Module or name in vars(module) or name.startswith("__"):
            continue
        if (owner, name) in seen:
            continue
        seen.add((owner, name))
        label = f"{owner.__name__}.{name} (a class attribute read by {where})"
        namespace = cast(dict, vars(owner))  # a mappingproxy: read with .get, as the guard reads dicts
        if is_plain(value := vars(owner)[name]) or is_plain_tree(value):  # a live view of the class's namespace
            checks.append((label, namespace, name, copy.deepcopy(value), False, None))
        elif isinstance(value, (types.FunctionType, property, staticmethod, classmethod)):  # a method patched
            checks.append((label, namespace, name, value, True, None))
    return checks
