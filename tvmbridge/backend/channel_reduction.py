"""Reductions over the contiguous axes with a kept axis outside them: vector partial sums.

A BatchNorm's statistics and gradients sum an NCHW tensor over N, H and W for each channel C
(``collapse_sum`` to ``(1, C, 1, 1)``, ``sum`` over axes 0, 2, 3). The reduced axes end in the
contiguous one, but a kept axis (C) lies between them, so neither :class:`RowReduction` (one
trailing reduced axis) nor the column rule (a kept contiguous axis) takes them, and the fallback
left each channel's sum one serial chain of scalar adds: one add's latency per element, a float64
accumulator (ATen's CPU accumulation type) at a fraction of the memory's speed. This rule
``rfactor``s the trailing reduced axes (fused, split into vectors) into one partial sum per lane:
channels in parallel, inside each the leading reduced axes (N) and the vectors of H x W in memory
order, a vector add per vector read; then each channel's lanes are summed. The sum's order is
that of a vectorized kernel (eager's own kernels also sum in lanes), not the serial one.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from .elementwise_rule import static_numel, vector_lanes


def _reduced_in_memory_order(stmt: s_tir.SBlock, reduced: set[int]) -> list[int] | None:
    """The reduced iteration variables (their positions) that index the last dims of every read
    that uses any reduced variable, in memory order (``x[n, c, h, w]``: h, w): fused, they walk
    memory. None where the reads disagree or end in a kept or computed index."""
    ivars = [iv.var for iv in stmt.iter_vars]
    found: list[int] | None = None
    for region in stmt.reads:
        mins = [r.min for r in region.region]
        if not any(v.same_as(ivars[i]) for m in mins for v in tirx.analysis.undefined_vars(m) for i in reduced):
            continue  # a per-channel operand (a mean, a scale)
        suffix: list[int] = []
        for m in reversed(mins):
            at = next((i for i in reduced if m.same_as(ivars[i])), None)
            if at is None:
                break
            suffix.insert(0, at)
        if not suffix or (found is not None and found != suffix):
            return None
        found = suffix
    return found


class ChannelReduction(CPUScheduleRule):
    """One reduction block (after inlining injective producers) with kept axes and a trailing run
    of reduced axes read in memory order, static and a whole number of vectors long: see the
    module docstring."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or infos[-1].is_injective() or not all(i.is_injective() for i in infos[:-1]):
            return None
        try:
            for info in infos[:-1]:
                sch.compute_inline(info.block_rv)
        except s_tir.ScheduleError:
            return None
        block = infos[-1].block_rv
        kinds = infos[-1].dom_kind()
        loops = sch.get_loops(block)
        stmt = sch.get(block)
        if len(loops) != len(kinds) or "S" not in kinds or "R" not in kinds or len(stmt.writes) != 1:
            return None
        inner = _reduced_in_memory_order(stmt, {i for i, k in enumerate(kinds) if k == "R"})
        if inner is None:
            return None
        length = static_numel(sch, [loops[i] for i in inner])
        lanes = vector_lanes(target, sch, block)
        if length is None or length % lanes or length < 2 * lanes:
            return None
        kept = [lp for lp, k in zip(loops, kinds) if k == "S"]
        leading = [lp for i, (lp, k) in enumerate(zip(loops, kinds)) if k == "R" and i not in inner]
        sch.reorder(*kept, *leading, *(loops[i] for i in inner))
        fused = sch.fuse(*(loops[i] for i in inner)) if len(inner) > 1 else loops[inner[0]]
        _, lane = sch.split(fused, factors=[None, lanes])
        partial = sch.rfactor(lane, factor_axis=len(stmt.writes[0].source.shape))
        at = sch.get_loops(partial)  # [kept..., leading..., vectors, lane]: new loops, the same order
        if len(at) != len(kept) + len(leading) + 2:
            return None
        sch.parallel(sch.fuse(*at[: len(kept)]) if len(kept) > 1 else at[0])
        sch.vectorize(at[-1])  # the lanes' zeroing stays inside, under the first vector's condition
        return sch
