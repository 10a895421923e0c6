"""A module's output as flat tensors and back, objects torch's pytree does not know included.

transformers' models return key/value caches (``DynamicCache``, ``EncoderDecoderCache``: plain
objects holding tensors) inside their outputs even in training. torch.export can only return
what pytree flattens, and registering those classes with pytree would change a global registry
this library does not own. So the output is flattened by pytree as far as pytree knows it, and
each leaf that is an object holding tensors is taken apart here: its tensors become outputs and
its structure a template, from which every call rebuilds an equal object around the call's
tensors (no copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

# output leaves returned as they are: immutable, and (not being symbolic) fixed for a compiled
# variant, whose guards fix everything the forward could compute them from
_CONSTANTS = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th tensor of an object goes."""

    index: int


@dataclass(frozen=True)
class _Obj:
    """An object rebuilt without calling its ``__init__``: its class and its (templated) fields."""

    cls: type
    fields: dict[str, Any]


@dataclass(frozen=True)
class OutputLayout:
    """How flat tensors make the module's output: pytree's spec, in which the leaves at
    ``templates``' positions are objects rebuilt from ``counts[i]`` tensors each (1 for a tensor)."""

    spec: pytree.TreeSpec
    counts: tuple[int, ...]
    templates: dict[int, Any]

    @property
    def num_tensors(self) -> int:
        return sum(self.counts)

    def __str__(self) -> str:
        objects = ", ".join(f"{i}: {type_name(t)}x{self.counts[i]}" for i, t in sorted(self.templates.items()))
        return f"{self.spec}" + (f" with objects {{{objects}}}" if objects else "")


def type_name(template: Any) -> str:
    return template.cls.__qualname__ if isinstance(template, _Obj) else type(template).__qualname__


def _holds_tensor(x: Any, seen: set[int]) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if id(x) in seen:
        return False
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v, seen) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensor(v, seen) for v in x.values())
    if _is_plain_object(x):
        return any(_holds_tensor(v, seen) for v in vars(x).values())
    return False


def _is_plain_object(x: Any) -> bool:
    return hasattr(x, "__dict__") and not isinstance(x, (type, torch.nn.Module)) and not callable(x)


def _template(x: Any, found: list[tuple[str, torch.Tensor]], where: str) -> Any:
    """``x`` with its tensors replaced by slots (appended to ``found`` with their path); parts
    that hold no tensor are kept as they are (shared, not copied)."""
    if isinstance(x, torch.Tensor):
        found.append((where, x))
        return _Slot(len(found) - 1)
    if not _holds_tensor(x, set()):
        return x
    if isinstance(x, (list, tuple)):
        items = [_template(v, found, f"{where}[{i}]") for i, v in enumerate(x)]
        return x._make(items) if hasattr(x, "_make") else type(x)(items)
    if isinstance(x, dict):
        return type(x)((k, _template(v, found, f"{where}[{k!r}]")) for k, v in x.items())
    return _Obj(type(x), {k: _template(v, found, f"{where}.{k}") for k, v in vars(x).items()})


def _fill(t: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(t, _Slot):
        return tensors[t.index]
    if isinstance(t, _Obj):
        cls: Any = t.cls  # mypy reads __new__ off a type as type.__new__, not the class's own
        obj = cls.__new__(cls)
        obj.__dict__.update({k: _fill(v, tensors) for k, v in t.fields.items()})
        return obj
    if isinstance(t, (list, tuple)) and not isinstance(t, str):
        items = [_fill(v, tensors) for v in t]
        return t._make(items) if hasattr(t, "_make") else type(t)(items)
    if isinstance(t, dict):
        return type(t)((k, _fill(v, tensors)) for k, v in t.items())
    return t


def labelled_output_tensors(out: Any) -> tuple[list[tuple[str, torch.Tensor]], OutputLayout]:
    """The output's tensors in order, each with its path (``"output.logits"``, ``"output.cache.
    layers[0].keys"``), and the layout that rebuilds the output from them."""
    leaves_with_paths, spec = pytree.tree_flatten_with_path(out)
    flat: list[tuple[str, torch.Tensor]] = []
    counts: list[int] = []
    templates: dict[int, Any] = {}
    for i, (path, leaf) in enumerate(leaves_with_paths):
        where = "output" + pytree.keystr(path)
        if type(leaf) in _CONSTANTS:  # ``loss=None`` in eval: the same on every call of the variant
            templates[i] = leaf
            counts.append(0)
            continue
        if isinstance(leaf, torch.Tensor) or not _holds_tensor(leaf, set()):
            flat.append((where, leaf))
            counts.append(1)
            continue
        found: list[tuple[str, torch.Tensor]] = []
        templates[i] = _template(leaf, found, where)
        flat.extend(found)
        counts.append(len(found))
    return flat, OutputLayout(spec, tuple(counts), templates)


def flatten_output(out: Any) -> tuple[list[Any], OutputLayout]:
    """The output's tensors (and leaves neither tensors nor constants, which the trace refuses)
    and its layout."""
    flat, layout = labelled_output_tensors(out)
    return [x for _, x in flat], layout


def unflatten_output(values: list[Any], layout: OutputLayout) -> Any:
    """The module's output around ``values`` (what ``flatten_output`` gave, in its order)."""
    leaves, start = [], 0
    for i, count in enumerate(layout.counts):
        part = list(values[start : start + count])
        leaves.append(_fill(layout.templates[i], part) if i in layout.templates else part[0])
        start += count
    return pytree.tree_unflatten(leaves, layout.spec)
