"""The bridge's converters by aten op, registered by the :func:`converter` decorator.

A converter is a plain function of the importer (``frontend.importer.BridgeImporter``: its
``env``, ``block_builder``, ``prim``, ``range_flag``, ``random_input``...) and the fx node::

    @converter("embedding.default")
    def embedding(importer, node): ...

    @converter("slice.Tensor", wraps_default=True)   # also gets TVM's converter of the op
    def slice_traced(importer, node, default): ...

Each aten op has at most one (a second is a ``ValueError`` naming both). ``BridgeImporter``
puts them all over TVM's table (:func:`bind`); ops the frontend lacks are added.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from analysis.registry import Registry, describe


@dataclass(frozen=True)
class Converter:
    """A registered converter: ``fn(importer, node)``, or ``fn(importer, node, default)`` where it
    ``wraps_default`` (``default(node)``: TVM's converter of the same op)."""

    fn: Callable[..., Any]
    wraps_default: bool = False


# aten overload name ("slice.Tensor"; "getitem") -> converter
CONVERTERS: Registry[str, Converter] = Registry("converter")


def converter(*ops: str, wraps_default: bool = False) -> Callable[[Callable], Callable]:
    """Make the decorated function the bridge's converter of each aten op in ``ops`` (overload
    names, as ``node.target.__name__`` gives them). ``wraps_default``: it gets TVM's converter
    of the op as its third argument (the op must be in TVM's table)."""
    return CONVERTERS.decorator(*ops, wrap=lambda fn: Converter(fn, wraps_default))


def bind(importer: Any, defaults: dict[str, Callable]) -> dict[str, Callable[[torch.fx.Node], Any]]:
    """Every registered converter as TVM's table wants it, ``fn(node)``, bound to ``importer``
    (``defaults``: TVM's table, whose converters the wrapping ones get)."""
    table: dict[str, Callable[[torch.fx.Node], Any]] = {}
    for op, entry in CONVERTERS.items():
        if not entry.wraps_default:
            table[op] = functools.partial(entry.fn, importer)
        elif op in defaults:
            table[op] = functools.partial(entry.fn, importer, default=defaults[op])
        else:
            raise ValueError(f"{describe(entry)} wraps TVM's converter of {op}, which TVM's table lacks")
    return table


# fx types every argument of a node as ``torch.fx.node.Argument``, a union of ~20 types (Node,
# int, list, slice, dtype, ...), so ``node.args[0].meta`` or ``float(node.args[1])`` is a type
# error although the op's schema fixes what each position holds. Converters read a node's
# arguments through these two, as the schema's values: ``Any`` to the type checker.
def args_of(node: torch.fx.Node) -> tuple[Any, ...]:
    """``node.args``, as the op's schema gives them (see above)."""
    return node.args


def kwargs_of(node: torch.fx.Node) -> Mapping[str, Any]:
    """``node.kwargs``, as the op's schema gives them (see above)."""
    return node.kwargs


def op_name(node: torch.fx.Node) -> str:
    """The aten overload name of the op a ``call_function`` node calls (``clamp_min.default``)."""
    target = node.target
    assert not isinstance(target, str), f"{node.format_node()} calls no op"  # a method or attribute name
    return target.__name__


def out_dtype(node: torch.fx.Node) -> str:
    """The dtype of the node's traced value, as Relax names it (``float32``)."""
    return str(node.meta["val"].dtype).removeprefix("torch.")


def uses_of_item(node: torch.fx.Node, index: int) -> list[torch.fx.Node]:
    """The ``getitem`` nodes reading output ``index`` of a multi-output node, where used."""
    return [u for u in node.users if u.target is operator.getitem and u.args[1] == index and u.users]
