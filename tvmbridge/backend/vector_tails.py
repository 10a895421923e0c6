"""Rows whose length is no multiple of the vector width (a 30522-word vocabulary, 1000 classes).

A split by the vector width leaves the last vector of such a row partial, under a predicate
that varies by lane, and TVM's vectorizer then makes the whole loop scalar; the reduction rule
refused such rows, so a vocabulary's softmax ran as serial sums. Here the predicate is marked
``likely``, which TVM's LoopPartition (with ``codegen.LOOP_PARTITION``) peels off the vector
loop's outer loop: every vector but the last runs unmasked and vectorized, the last one scalar.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import get_extent


def split_into_vectors(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV, lanes: int):
    """``loop`` split into an outer loop and an inner vector of ``lanes`` (vectorized); whether the
    last vector is partial (then the block's predicate is to be marked: :func:`with_tail_predicates`)."""
    partial = get_extent(sch, loop) % lanes != 0
    outer, vec = sch.split(loop, factors=[None, lanes])
    sch.vectorize(vec)
    return outer, partial


def with_tail_predicates(
    sch: s_tir.Schedule, split: list[str], partials: dict[str, tuple[int, int, int]] | None = None
) -> s_tir.Schedule:
    """The schedule's kernel with the last, partial vector of each row guarded by a ``likely``
    predicate, which TVM's LoopPartition peels off the vector loop's
    outer loop, so that every other vector stays unmasked and vectorized (a vector loop under a
    condition that varies by lane is made scalar). Partial-sum blocks (``partials``: row length,
    lane axis, lanes) get their predicate back: ``compute_at`` regenerates a moved block's loops from
    its variables' domains and drops the one the split gave it (``r_o * lanes + lane < extent``),
    so the last vector read past the row. The ``split`` blocks keep theirs, marked likely."""

    partials = partials or {}

    def guard(realize: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
        block = realize.block
        if block.name_hint in split:
            return s_tir.SBlockRealize(realize.iter_values, tirx.likely(realize.predicate), block)
        if block.name_hint not in partials:
            return realize
        extent, axis, lanes = partials[block.name_hint]
        lane_var = block.writes[0].region[axis].min  # the partial buffer's axis ``axis`` is the lane
        lane = next(i for i, iv in enumerate(block.iter_vars) if iv.var.same_as(lane_var))
        outer = next(i for i, iv in enumerate(block.iter_vars) if iv.iter_type == tirx.IterVar.CommReduce)
        values = realize.iter_values
        inside = tirx.likely(values[outer] * lanes + values[lane] < extent)
        kept = realize.predicate
        predicate = inside if isinstance(kept, tirx.IntImm) and int(kept) else tirx.And(kept, inside)
        return s_tir.SBlockRealize(values, predicate, block)

    return s_tir.Schedule(tvm_ffi.structural_map(sch.mod["main"], [(s_tir.SBlockRealize, guard)]))
