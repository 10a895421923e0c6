"""Default CPU schedules for the kernels TVM keeps (everything but the offloaded matmuls).

Untuned llvm kernels are serial scalar loops. dlight has CPU rules for GEMV and for row-wise
reductions (softmax, norms); it has none for the elementwise chains that fusion produces (GELU
and its gradient, bias adds, dropout multiplies) nor for column reductions (``collapse_sum`` of a
bias gradient). Two rules fill that gap, in dlight's own form:

* :class:`Elementwise` (:mod:`.elementwise_rule`): inline every block into the output it feeds
  (except broadcast operands, far smaller than the output: those are computed once, not once per
  element they are read for; a per-row one inside the parallel row loop, a column one before
  it), fuse each output's loops, parallelize the outer part over the cores and vectorize the
  inner part to the target's vector width;
* :class:`SpatialParallel`: a fallback for any single reduction block: put the spatial loops
  outermost and parallelize them (the reduction runs serially inside each thread).

And one that improves on dlight's own row-reduction rule:

* :class:`RowReduction`: softmax and layer-norm statistics. dlight's ``cpu.Reduction`` leaves
  each reduction a serial chain of scalar adds (one FP-add latency per element); this rule first
  ``rfactor``s every reduction into a vector of partial results (one lane per residue of the
  innermost reduction index), then nests all blocks under the parallel row loop as dlight does.
  (dlight avoids rfactor because it must come before ``compute_at``; done in that order it works.)

:class:`Elementwise` also tiles transposes: when the output's innermost axis is not the one its
largest input is contiguous in, both axes are split into vector-wide tiles so reads and writes
each touch whole cache lines (attention's head split/merge copies).

Symbolic sizes (a variant serving every sequence length): an elementwise kernel of unknown size
is always parallel, vectorized along a static innermost axis; a row reduction over a symbolic
row length keeps a serial sum per row, rows in parallel.

And one for per-channel sums (:mod:`.channel_reduction`): :class:`ChannelReduction`, a sum over
N, H and W keeping C (BatchNorm's statistics and gradients) in vector partial sums along H x W.

Rules are tried in order: ``RowReduction``, ``ChannelReduction``, ``dlight.cpu.Reduction``, then
``Elementwise``, ``Elementwise(fuse=False)`` and ``SpatialParallel``.

How many threads run a parallel loop is the TVM runtime's choice, made once per process
(``devices.prepare_cpu_runtime``); where it is one, the schedules' gain is vectorization and loop
order. The README gives what each rule buys, measured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import get_extent
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from ..ir import first_schedule
from .channel_reduction import ChannelReduction
from .elementwise_rule import Elementwise, selects_between_reads, static_numel, vector_lanes
from .flatten_hazard import FlattenSafe
from .inline_budget import kept_as_blocks
from .rule_filters import Guarded, NoRepeatedWork, ReductionKernels, WithinInlineBudget
from .shared_kernels import largest_tensor, static_largest
from .vector_tails import split_into_vectors, with_tail_predicates


class RowReduction(CPUScheduleRule):
    """Row reductions with vectorized partial sums (see the module docstring): blocks sharing
    leading spatial axes, as in ``dlight.cpu.Reduction``, whose last block may be injective
    (softmax, layer norm) or the reduction itself (a row sum, softmax's backward ``sum(dy*y)``)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or all(i.is_injective() for i in infos):
            return None
        if _inline_elementwise_chains(sch, infos):
            infos = normalize_prim_func(sch)
            if not infos:
                return None
        leading = []
        for info in infos:
            kinds = info.dom_kind()
            if not kinds or kinds[0] != "S":
                return None
            leading.append(len(kinds) - len(kinds.lstrip("S")))
        n_lead = min(leading)
        lanes = vector_lanes(target, sch, infos[-1].block_rv)
        ends_in_reduction = not infos[-1].is_injective()
        injective = [i.block_rv for i in infos[:-1] if i.is_injective()]
        partials = []
        tails: dict[str, tuple[int, int, int]] = {}  # partial block -> (row length, lane axis, lanes): a partial vector
        for info in infos:  # rfactor first: each reduction still owns its loop nest
            if info.is_injective():
                continue
            if len(info.dom_kind()) - leading[infos.index(info)] != 1 or not _reduces_rows(sch, info.block_rv):
                return None  # one trailing reduction axis, along memory: a row reduction
            r = sch.get_loops(info.block_rv)[-1]
            extent = get_extent(sch, r)
            if not isinstance(extent, int):
                continue  # a symbolic row length: a serial sum per row (rows still in parallel)
            if extent < 2 * lanes:
                return None
            _, r_i = sch.split(r, factors=[None, lanes])
            axis = len(sch.get(info.block_rv).iter_vars) - 1
            partials.append(sch.rfactor(r_i, factor_axis=axis))
            if extent % lanes:  # a vocabulary-long row (30522): the last vector is partial
                tails[sch.get(partials[-1]).name_hint] = (extent, axis, lanes)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        last = blocks[-1]  # the final injective block, or the last reduction's write-back
        loops = sch.get_loops(last)
        rows = sch.fuse(*loops[:n_lead]) if n_lead > 1 else loops[0]
        sch.parallel(rows)
        split = []  # injective blocks whose last vector is partial
        if not ends_in_reduction and _vectorize_inner(sch, last, lanes):
            split.append(sch.get(last).name_hint)
        for b in reversed(blocks[:-1]):
            sch.compute_at(b, rows, preserve_unit_loops=True)
        for b in injective:
            if _vectorize_inner(sch, b, lanes):
                split.append(sch.get(b).name_hint)
        for b in partials:  # [rows, lane, 1..., r_o] -> [rows, 1..., r_o, lane (vector)]
            loops = sch.get_loops(b)
            lane = next(lp for lp in loops[1:-1] if get_extent(sch, lp) == lanes)
            sch.reorder(loops[-1], lane)
            sch.vectorize(lane)
        return with_tail_predicates(sch, split, tails) if tails or split else sch


def _reduces_rows(sch: s_tir.Schedule, block) -> bool:
    """Whether the block's reduction index is the contiguous (last) index of what it reads
    (a row sum), not a strided one (a column sum such as a bias gradient's ``collapse_sum``)."""
    stmt = sch.get(block)
    r_var = stmt.iter_vars[-1].var
    reads = [r for r in stmt.reads if len(r.region) >= 1]
    return bool(reads) and all(
        any(v.same_as(r_var) for v in tirx.analysis.undefined_vars(r.region[-1].min))
        for r in reads
        if any(v.same_as(r_var) for reg in r.region for v in tirx.analysis.undefined_vars(reg.min))
    )


def _inline_elementwise_chains(sch: s_tir.Schedule, infos: list) -> bool:
    """Inline injective blocks whose consumers are all injective (a dropout multiply after a
    softmax, a subtract before an exp), or that one reduction alone reads, once per element (the
    ``exp`` of a softmax's sum): no full-size intermediate between them. A producer read by a
    reduction and by other blocks stays, so nothing is computed twice, and so does a block too
    large to copy into its readers (:mod:`.inline_budget`). True if anything was inlined."""
    injective = {sch.get(i.block_rv).name_hint for i in infos if i.is_injective()}
    kept = kept_as_blocks(sch, [i.block_rv for i in infos], {sch.get(infos[-1].block_rv).name_hint})
    changed = False
    for info in reversed(infos[:-1]):
        if not info.is_injective() or sch.get(info.block_rv).name_hint in kept:
            continue
        consumers = sch.get_consumers(info.block_rv)
        if consumers and (
            all(sch.get(c).name_hint in injective for c in consumers)
            or (len(consumers) == 1 and _domain_size(sch, consumers[0]) == _domain_size(sch, info.block_rv))
        ):
            try:
                sch.compute_inline(info.block_rv)
                changed = True
            except s_tir.ScheduleError:
                pass
    return changed


def _domain_size(sch: s_tir.Schedule, block) -> int | None:
    """How many times the block runs (its variables' extents multiplied), where static."""
    size = 1
    for iv in sch.get(block).iter_vars:
        if not isinstance(iv.dom.extent, tirx.IntImm):
            return None
        size *= int(iv.dom.extent)
    return size


def _vectorize_inner(sch: s_tir.Schedule, block, lanes: int) -> bool:
    """The block's innermost loop in vectors; True where the last vector is partial (the split's
    predicate is then to be marked likely: :func:`with_tail_predicates`)."""
    loops = sch.get_loops(block)
    if len(loops) <= 1 or selects_between_reads(sch, block):
        return False
    extent = get_extent(sch, loops[-1])
    if not isinstance(extent, int):
        return False
    if extent > lanes and (extent % lanes == 0 or extent >= 2 * lanes):
        return split_into_vectors(sch, loops[-1], lanes)[1]
    elif 2 <= extent <= lanes:
        sch.vectorize(loops[-1])
    return False


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
        n = static_numel(sch, spatial)
        lanes = vector_lanes(target, sch, info.block_rv)
        col = _contiguous_spatial_loop(sch, info.block_rv, loops, kinds)
        col_extent = get_extent(sch, col) if col is not None else None
        # a partial last column block only over static loops: with a symbolic reduction inside,
        # TVM's LoopPartition mixes the narrowed int32 indices with the int64 size ("mismatched types")
        ragged_ok = all(isinstance(get_extent(sch, lp), int) for lp in loops)
        if (
            col is not None
            and isinstance(col_extent, int)
            and col_extent >= 4 * lanes
            and (col_extent % lanes == 0 or ragged_ok)
        ):
            # column reduction (e.g. a bias gradient): threads own column blocks, rows stream
            # through, columns are vectors: [spatial outer (parallel), reduce, columns (vector)]
            col_o, col_i = sch.split(col, factors=[None, lanes])
            rest = [lp for lp in spatial if not lp.same_as(col)]
            outer = sch.fuse(*rest, col_o) if rest else col_o
            sch.reorder(outer, *reduce, col_i)
            sch.parallel(outer)
            init = sch.decompose_reduction(info.block_rv, reduce[0])
            if col_extent % lanes == 0:
                return sch  # LLVM vectorizes the unit-stride column loop itself
            # a vocabulary's bias (30522 columns): the last column block is partial
            return with_tail_predicates(sch, [sch.get(b).name_hint for b in (info.block_rv, init)])
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


def cpu_rules() -> list[CPUScheduleRule]:
    """The default CPU rules, first match wins. (dlight's CPU GEMV rule is left out: it asserts on
    scalar reductions, and dense matmuls are offloaded.)"""
    rules = [
        ReductionKernels(RowReduction()),
        ReductionKernels(WithinInlineBudget(ChannelReduction()), single_output=True),
        ReductionKernels(WithinInlineBudget(dlight.cpu.Reduction()), single_output=True),
        Elementwise(),
        Elementwise(fuse=False),  # where the fused schedule has a flatten hazard
        WithinInlineBudget(SpatialParallel()),
    ]
    return [Guarded(NoRepeatedWork(FlattenSafe(r))) for r in rules]


def apply_cpu_schedules(
    mod: tvm.IRModule, target: Target, on_kernel: Callable[[tvm.ir.GlobalVar, tirx.PrimFunc], None] | None = None
) -> tvm.IRModule:
    """Schedule every TIR function of ``mod`` that no rule has scheduled yet, in a copy;
    ``on_kernel`` is told each kernel in its final form as soon as it is."""
    out = mod.clone()
    for gv, func in scheduled_kernels(mod, target):
        out[gv] = func
        if on_kernel is not None:
            on_kernel(gv, func)
    return out


def scheduled_kernels(mod: tvm.IRModule, target: Target) -> Iterator[tuple[tvm.ir.GlobalVar, tirx.PrimFunc]]:
    """Each TIR function of ``mod`` as it is to be compiled, one at a time (what dlight's
    ``ApplyDefaultSchedule`` makes of it: the first rule's schedule, marked scheduled; a function
    scheduled before, or that no rule takes, as it is), so that a caller can compile the first
    ones while the later ones are scheduled."""
    rules = cpu_rules()
    one_thread = int(target.attrs.get("num-cores", 0)) == 1
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        if not bool(func.attrs is not None and func.attrs.get("tirx.is_scheduled", False)):
            sch = first_schedule(rules, func, target)
            if sch is not None:
                func = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        yield gv, (serial_loops(func) if one_thread or too_small_for_threads(func) else func)


#: a kernel whose every tensor is smaller than this (elements) keeps its loops serial: PyTorch's
#: own grain (``at::internal::GRAIN_SIZE``), below which its elementwise ops stay on one thread
MIN_PARALLEL_ELEMENTS = 32768


def too_small_for_threads(func: tirx.PrimFunc) -> bool:
    """Whether every tensor of ``func`` (each member's, for a kernel shared across sizes) is
    below :data:`MIN_PARALLEL_ELEMENTS`: starting its threads costs more than they would save."""
    bound = largest_tensor(func) or static_largest(func)
    return bound is not None and bound < MIN_PARALLEL_ELEMENTS


def serial_loops(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its parallel loops serial: for a target of one core (``devices.cpu_threads``),
    where launching a parallel loop costs more than any kernel saves by it (every rule's, dlight's
    and a tuning record's alike)."""

    def serial(loop: tirx.For) -> tirx.For:
        if loop.kind != tirx.ForKind.PARALLEL:
            return loop
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body, None, loop.annotations)

    return tvm_ffi.structural_map(func, [(tirx.For, serial)])


def default_cpu_schedule(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The schedule ``apply_cpu_schedules`` gives one kernel, with its trace; None when no rule
    takes it."""
    return first_schedule(cpu_rules(), func, target)
