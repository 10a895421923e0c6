"""One canonical form for a call of ``module.forward``, however the caller wrote it.

The same call written with positional or keyword arguments, or with a default passed explicitly,
must give one signature: the guard compares calls in this form and the export traces it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConversionError


def canonical_call(
    forward: Callable | inspect.Signature, args: tuple, kwargs: dict | None
) -> tuple[tuple, dict[str, Any]]:
    """Bind a call to ``forward``'s signature, defaults applied: positional-only and ``*args``
    stay positional, named parameters become keywords in signature order, ``**kwargs`` entries
    follow sorted by name, and non-tensor arguments equal to their default are dropped."""
    sig = forward if isinstance(forward, inspect.Signature) else inspect.signature(forward)
    try:
        bound = sig.bind(*args, **(kwargs or {}))
    except TypeError as exc:
        raise ConversionError("inputs", f"inputs do not match forward{sig}: {exc}") from None
    bound.apply_defaults()
    pos: list[Any] = []
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        param = sig.parameters[name]
        if is_default(value, param.default):
            continue
        if param.kind == inspect.Parameter.POSITIONAL_ONLY:
            pos.append(value)
        elif param.kind == inspect.Parameter.VAR_POSITIONAL:
            pos.extend(value)
        elif param.kind == inspect.Parameter.VAR_KEYWORD:
            named.update(sorted(value.items()))
        else:
            named[name] = value
    return tuple(pos), named


def is_default(value: Any, default: Any) -> bool:
    """An argument equal to its (non-tensor) default, so omitting it and passing it explicitly
    give the same signature."""
    if default is inspect.Parameter.empty or isinstance(value, torch.Tensor):
        return False
    if value is default:
        return True
    return isinstance(default, (bool, int, float, str)) and type(value) is type(default) and value == default
