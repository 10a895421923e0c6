"""What the bridge refuses before converting, each with where in the user's code it came from:
an op no converter takes, a size that depends on tensor values, a zero-size value."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch.export import ExportedProgram
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from ..errors import ConversionError, UnsupportedOpError
from .converters import CONVERTERS
from .converters.layout import empty_cat_part
from .converters.random import is_random
from .converters.registry import args_of, kwargs_of
from .program_facts import COPY_OPS
from .provenance import origins


def known_ops() -> set[str]:
    """The aten ops the bridge converts: TVM's table and the registered converters (the keys of
    ``BridgeImporter().convert_map``)."""
    return set(ExportedProgramImporter().convert_map) | set(CONVERTERS)


def unsupported_ops(ep: ExportedProgram) -> list[str]:
    """aten ops in the graph that the importer has no converter for (random ops are all handled)."""
    known = known_ops()
    return sorted(
        {
            n.target.__name__
            for n in ep.graph.nodes
            if n.op == "call_function" and n.target.__name__ not in known and not is_random(n)
        }
    )


def dropped_by_cat(node: torch.fx.Node, val: torch.Tensor) -> bool:
    """Every use of ``node`` is a ``cat`` (directly or through copies and casts) that drops it as
    an empty part (``converters.layout.cat_legacy_empty``)."""
    for user in node.users:
        name = getattr(user.target, "__name__", "")
        if name == "cat.default":
            args = args_of(user)
            dim = args[1] if len(args) > 1 else kwargs_of(user).get("dim", 0)
            if not empty_cat_part(val, dim):
                return False
        elif name not in COPY_OPS or not dropped_by_cat(user, val):
            return False
    return bool(node.users)


def data_dependent_values(ep: ExportedProgram) -> list[str]:
    """Values whose shape holds a size no input shape gives (an unbacked symbol): what
    ``x[bool_mask]`` or ``nonzero`` returns, as ``"name = target (shape)"``."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found = []
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val.shape):
            found.append(f"{n.name} = {n.target} {tuple(val.shape)}")
    return found


def zero_size_values(ep: ExportedProgram) -> list[str]:
    """Values the graph uses that have a zero-size dimension (a parameter, a slice ``x[:, :0]``, a
    split part of size 0), as ``"name (shape)"``. Left out: outputs nothing reads (eval-mode
    batch norm's empty statistics), except a split's (Relax splits at every boundary), and an
    empty part only ``cat`` reads (``cat`` drops it, ``converters.layout.cat_legacy_empty``)."""
    found = []
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        many = isinstance(val, (list, tuple))
        split = many and getattr(node.target, "__name__", "").startswith(("split", "unbind"))
        used = {u.args[1] for u in node.users if u.target is operator.getitem and u.users} if many else set()
        for i, v in enumerate(val if many else [val]):
            if not isinstance(v, torch.Tensor) or not any(isinstance(d, int) and d == 0 for d in v.shape):
                continue
            if (not many and not node.users) or (many and not split and i not in used):
                continue
            if not many and dropped_by_cat(node, v):
                continue
            found.append(f"{node.name} ({', '.join(map(str, v.shape))})")
    return found


def _origins_of(ep: ExportedProgram, chosen: Callable[[torch.fx.Node], bool]) -> tuple[str, ...]:
    """Where the chosen computing nodes came from (see ``provenance``)."""
    return origins(n for n in ep.graph.nodes if n.op == "call_function" and chosen(n))


def refuse_unconvertible(ep: ExportedProgram) -> None:
    """Raise for the first of: data-dependent sizes (which no converter could take), ops without a
    converter, zero-size values."""
    dependent = data_dependent_values(ep)
    if dependent:
        raise ConversionError(
            "convert",
            f"{dependent[0]} has a size that depends on the values of a tensor (boolean-mask indexing "
            "x[mask], nonzero, torch.where(cond), masked_select, unique): compiled code needs sizes known from "
            "the input shapes; write it with torch.where(cond, a, b) (a loss over masked positions as a masked "
            "mean), "
            "or use torch.compile(model, backend='tvmbridge'), which runs that part in PyTorch and the rest on TVM, "
            "or fallback=True",
            sources=_origins_of(ep, lambda n: any(d.startswith(f"{n.name} = ") for d in dependent)),
        )
    missing = unsupported_ops(ep)
    if missing:
        raise UnsupportedOpError(
            "convert",
            f"no Relax converter for {', '.join(missing)}; add one in tvmbridge/frontend/converters/ "
            "(a function under the @converter decorator) or call with fallback=True to keep PyTorch",
            op=missing[0],
            sources=_origins_of(ep, lambda n: getattr(n.target, "__name__", "") in missing),
        )
    empty = zero_size_values(ep)
    if empty:
        raise ConversionError(
            "convert",
            f"{empty[0]} has a zero-size dimension: TVM's kernels and gradients do not handle empty "
            "tensors (wrong strides, unsorted split indices); call with fallback=True to keep PyTorch",
            sources=_origins_of(ep, lambda n: any(e.startswith(f"{n.name} (") for e in empty)),
        )
