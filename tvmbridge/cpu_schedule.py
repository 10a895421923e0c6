"""Default CPU schedules for the kernels TVM keeps (everything but the offloaded matmuls).

Untuned llvm kernels are serial scalar loops. dlight has CPU rules for GEMV and for row-wise
reductions (softmax, norms); it has none for the elementwise chains that fusion produces (GELU
and its gradient, bias adds, dropout multiplies) nor for column reductions (``collapse_sum`` of a
bias gradient). Two rules fill that gap, in dlight's own form:

* :class:`Elementwise`: inline every block into the last, fuse its loops, parallelize the outer
  part over the cores and vectorize the inner part to the target's vector width;
* :class:`SpatialParallel`: a fallback for any single reduction block: put the spatial loops
  outermost and parallelize them (the reduction runs serially inside each thread).

Rules are tried in order: ``dlight.cpu.Reduction`` and ``GEMV`` first, then these.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import get_extent
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width

_MIN_PARALLEL = 4096  # below this many elements a kernel stays serial (thread start-up dominates)


def _vec_lanes(target: Target, sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int:
    bits = llvm_get_vector_width(target)
    stmt = sch.get(block)
    dtype_bits = stmt.writes[0].source.dtype.bits if stmt.writes else 32
    return max((bits if bits > 0 else 128) // dtype_bits, 2)


def _numel(sch: s_tir.Schedule, loops: list) -> int | None:
    n = 1
    for loop in loops:
        e = get_extent(sch, loop)
        if not isinstance(e, int):
            return None
        n *= e
    return n


class Elementwise(CPUScheduleRule):
    """All-injective kernels: one fused loop, parallel outside, vectorized inside."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(i.is_injective() for i in infos):
            return None
        for info in infos[:-1]:
            try:
                sch.compute_inline(info.block_rv)
            except s_tir.ScheduleError:
                return None
        block = infos[-1].block_rv
        loops = sch.get_loops(block)
        if not loops:
            return None
        n = _numel(sch, loops)
        if n is None:
            return None
        lanes = _vec_lanes(target, sch, block)
        inner_extent = get_extent(sch, loops[-1])
        if len(loops) > 1 and isinstance(inner_extent, int) and inner_extent >= 4 * lanes:
            # keep the innermost axis for contiguous vectors, parallelize the rest
            outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
            if inner_extent % lanes == 0:
                _, vec = sch.split(loops[-1], factors=[None, lanes])
                sch.vectorize(vec)
        else:
            fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
            if n % lanes == 0 and n >= 2 * lanes:
                outer, vec = sch.split(fused, factors=[None, lanes])
                sch.vectorize(vec)
            else:
                outer = fused
        if n >= _MIN_PARALLEL:
            sch.parallel(outer)
        return sch


class SpatialParallel(CPUScheduleRule):
    """One reduction block (after inlining injective producers): spatial loops outermost and
    parallel. Covers column reductions such as a bias gradient's ``collapse_sum``."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos:
            return None
        for info in infos[:-1]:
            if not info.is_injective():
                return None
            try:
                sch.compute_inline(info.block_rv)
            except s_tir.ScheduleError:
                return None
        info = infos[-1]
        loops = sch.get_loops(info.block_rv)
        kinds = info.dom_kind()
        if len(loops) != len(kinds) or "S" not in kinds:
            return None
        spatial = [lp for lp, k in zip(loops, kinds) if k == "S"]
        reduce = [lp for lp, k in zip(loops, kinds) if k != "S"]
        n = _numel(sch, spatial)
        lanes = _vec_lanes(target, sch, info.block_rv)
        col = _contiguous_spatial_loop(sch, info.block_rv, loops, kinds)
        col_extent = get_extent(sch, col) if col is not None else None
        if col is not None and isinstance(col_extent, int) and col_extent % lanes == 0 and col_extent >= 4 * lanes:
            # column reduction (e.g. a bias gradient): threads own column blocks, rows stream
            # through, columns are vectors: [spatial outer (parallel), reduce, columns (vector)]
            col_o, col_i = sch.split(col, factors=[None, lanes])
            rest = [lp for lp in spatial if not lp.same_as(col)]
            outer = sch.fuse(*rest, col_o) if rest else col_o
            sch.reorder(outer, *reduce, col_i)
            sch.parallel(outer)
            sch.decompose_reduction(info.block_rv, reduce[0])
            return sch  # LLVM vectorizes the unit-stride column loop itself
        sch.reorder(*spatial, *reduce)
        fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
        if n is not None and n >= 2:
            sch.parallel(fused)
        return sch


def _contiguous_spatial_loop(sch: s_tir.Schedule, block, loops: list, kinds: str):
    """The spatial loop that indexes the innermost (contiguous) axis of the block's input, if
    any: the reduction then runs over rows while a vector of columns accumulates."""
    stmt = sch.get(block)
    if not stmt.reads:
        return None
    last = stmt.reads[0].region[-1].min
    for loop, kind, iv in zip(loops, kinds, stmt.iter_vars):
        if kind == "S" and last.same_as(iv.var):
            return loop
    return None


class _Guarded(CPUScheduleRule):
    """A rule whose failure leaves the kernel to the next rule (or unscheduled, still correct)
    instead of aborting the build: dlight's analyses assert on shapes they do not expect."""

    def __init__(self, rule: CPUScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except (AssertionError, s_tir.ScheduleError, ValueError, tvm.TVMError):
            return None


def apply_cpu_schedules(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """Schedule every TIR function of ``mod`` that no rule has scheduled yet. (dlight's CPU GEMV
    rule is left out: it asserts on scalar reductions, and dense matmuls are offloaded.)"""
    rules = [dlight.cpu.Reduction(), Elementwise(), SpatialParallel()]
    with target:
        return dlight.ApplyDefaultSchedule(*[_Guarded(r) for r in rules])(mod)
