"""One canonical form for a call of ``module.forward``, however the caller wrote it.

The same call written with positional or keyword arguments, or with a default passed explicitly,
must give one signature: the guard compares calls in this form and the export traces it.
"""

from __future__ import annotations

import inspect
import numbers
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import ConversionError
from .call_state import PLAIN


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


# what a call may pass besides tensors and still be compiled: values, which the guard compares
# (and the trace bakes in) as they are, and functions, which are code as ``forward`` is
_VALUE_TYPES = (
    *PLAIN, numbers.Number, type, slice, type(Ellipsis), range, frozenset, torch.layout, torch.memory_format,
    torch.SymInt, torch.SymFloat, torch.SymBool, types.FunctionType, types.BuiltinFunctionType,
)  # fmt: skip


def opaque_arguments(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The call's non-tensor leaves that are objects rather than values (a transformers key/value
    cache, a ``torch.Generator``, a module passed in), labelled: compiled code would freeze such an
    object as the trace found it, the guard would let the same object through however its contents
    changed since (a cache grows every generation step), and the trace itself would write into
    it. Plain calls of tensors are answered without flattening."""
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return []
    found = []
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor) or isinstance(leaf, _VALUE_TYPES):
            continue
        where, rest = path[1], pytree.keystr(path[2:])
        label = f"{where.key}{rest}" if path[0].idx == 1 else f"argument {where.idx}{rest}"  # type: ignore[attr-defined]
        found.append((label, leaf))
    return found


def opaque_argument_reason(args: tuple, kwargs: dict) -> str | None:
    """Why the call cannot be compiled, if it passes an object (see :func:`opaque_arguments`)."""
    found = opaque_arguments(args, kwargs)
    if not found:
        return None
    label, leaf = found[0]
    kind = type(leaf).__name__
    hint = (
        "; generation with a key/value cache runs PyTorch (use_cache=False calls compile)"
        if kind.endswith("Cache")
        else ": pass its tensors, or values, instead"
    )
    return (
        f"{label} is a {kind} object, which compiled code would freeze as it is now (the guard cannot see "
        f"its contents change){hint}"
    )
