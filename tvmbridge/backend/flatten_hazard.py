"""Schedules that TVM's buffer flattening would miscompile, found before they are built.

``FlattenBuffer`` (TVM 0.27) passes every flattened index through ``IterMapSimplify``, which
handles a division whose dividend is offset by a constant that is not a multiple of the divisor
(``(i - 1) // 2``: a read at a shifted, strided position, as a padded pooling gradient makes) by
padding the whole iterator the index comes from. When that iterator is a fused loop, its other
splits are not corrected: with ``f`` fusing a (2, 6) loop nest, ``(f // 6) * 3 + (f % 6 - 1) // 2``
becomes ``(f + 1) // 2 - 4``, wrong for every ``f``, and the kernel reads the wrong elements with
no error (a max-pool's input gradient came out wrong). The unfused loop nest is flattened right.

:func:`flatten_hazard` finds the pattern in a scheduled kernel (a block index variable bound to a
split of a fused loop, divided with such an offset); :class:`FlattenSafe` refuses a rule's schedule
that has it, so the kernel goes to the next rule or stays unscheduled (serial, correct).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

_SKIPPED_FIELDS = frozenset({"span", "buffer", "alloc_buffers", "match_buffers", "reads", "writes", "annotations"})


def children(node: Any) -> Iterator[Any]:
    """Every statement or expression directly under ``node``, by TVM's own field reflection."""
    if isinstance(node, (list, tuple, tvm_ffi.Array)):
        yield from node
        return
    info = getattr(type(node), "__tvm_ffi_type_info__", None)
    while info is not None:
        for field in info.fields:
            if field.name not in _SKIPPED_FIELDS:
                value = getattr(node, field.name)
                if isinstance(value, (tirx.Stmt, tvm.ir.Expr, tvm_ffi.Array, s_tir.SBlock)):
                    yield value
        info = info.parent_type_info


def _nodes(root: Any) -> Iterator[Any]:
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(children(node))


def _has_division(expr: tvm.ir.Expr) -> bool:
    return any(isinstance(n, (tirx.FloorDiv, tirx.FloorMod)) for n in _nodes(expr))


def _constant_term(expr: tvm.ir.Expr) -> int:
    """The constant added at the top of ``expr``'s sum (``v - 1`` -> -1)."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Add):
        return _constant_term(expr.a) + _constant_term(expr.b)
    if isinstance(expr, tirx.Sub):
        return _constant_term(expr.a) - _constant_term(expr.b)
    return 0


def _block_hazard(realize: s_tir.SBlockRealize) -> str | None:
    block = realize.block
    split = {iv.var for iv, value in zip(block.iter_vars, realize.iter_values, strict=True) if _has_division(value)}
    for node in _nodes(block.body):
        if not isinstance(node, (tirx.FloorDiv, tirx.FloorMod)) or not isinstance(node.b, tirx.IntImm):
            continue
        divisor = int(node.b.value)
        if divisor <= 1 or _constant_term(node.a) % divisor == 0:
            continue
        if any(isinstance(n, tirx.Var) and n in split for n in _nodes(node.a)):
            return f"block {block.name_hint!r} divides {node.a} by {divisor} over a fused loop"
        if _has_division(node.a):  # the split made inside the index itself: ``(v % 24 - 17) // 2``
            return f"block {block.name_hint!r} divides {node.a} by {divisor} over a split of its own"
    return None


def flatten_hazard(func: tirx.PrimFunc) -> str | None:
    """Why ``FlattenBuffer`` would miscompile ``func`` as scheduled, or None."""
    for node in _nodes(func.body):
        if isinstance(node, s_tir.SBlockRealize):
            reason = _block_hazard(node)
            if reason is not None:
                return reason
    return None


class FlattenSafe(CPUScheduleRule):
    """``rule``'s schedule, unless it has a :func:`flatten_hazard`: then the next rule's."""

    def __init__(self, rule: CPUScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        space = self.rule.apply(func, target, tunable)
        sch = space[0] if isinstance(space, list) and space else space
        if sch is not None and flatten_hazard(sch.mod["main"]) is not None:
            return None
        return space
