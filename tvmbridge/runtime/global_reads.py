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

Globals read by helper functions the forward calls are not followed (their code is not the
forward's); functions, classes and modules in globals are not values and are not checked.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Iterator
from typing import Any, cast

import torch

from ..frontend.call_state import is_plain

Check = tuple[str, dict, str, Any, bool, Any]  # as ``state_guard.Check``


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _forward_function(module: torch.nn.Module) -> types.FunctionType | None:
    forward = inspect.unwrap(type(module).forward)
    return forward if isinstance(forward, types.FunctionType) else None


def global_checks(module: torch.nn.Module, seen: set[int]) -> list[Check]:
    """Checks of the plain globals ``module``'s forward reads (none for a forward in ``seen``,
    by code object: a class used many times is checked once)."""
    forward = _forward_function(module)
    if forward is None or id(forward.__code__) in seen:
        return []
    seen.add(id(forward.__code__))
    names = dict.fromkeys(name for code in _codes(forward.__code__) for name in code.co_names)
    where = f"{type(module).__name__}.forward"
    holder = forward.__globals__
    checks = [
        (f"global {name} (read by {where})", holder, name, copy.deepcopy(holder[name]), False, None)
        for name in names
        if name in holder and not name.startswith("__") and is_plain(holder[name])
    ]
    for name in names:
        owner = next((c for c in type(module).__mro__ if name in vars(c)), None)
        if owner is None or owner is torch.nn.Module or name in vars(module) or name.startswith("__"):
            continue
        if is_plain(value := vars(owner)[name]):  # a live view of the class's namespace
            label = f"{owner.__name__}.{name} (a class attribute read by {where})"
            namespace = cast(dict, vars(owner))  # a mappingproxy: read with .get, as the guard reads dicts
            checks.append((label, namespace, name, copy.deepcopy(value), False, None))
    return checks
