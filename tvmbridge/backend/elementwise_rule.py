"""The CPU rule for all-injective kernels (what fusion makes of elementwise chains, broadcasts,
copies, splits and concatenations): each output's loops fused, parallel outside, vectorized
inside.

Every block is inlined into the output it feeds, except broadcast operands far smaller than the
output: those are computed once, not once per element that reads them (a per-row one inside the
parallel row loop, a column one before it), and a chain of them (BatchNorm's per-channel scale
and shift, from the variance through its square root) is inlined into its last link, so it is one
loop per operand and not a loop per step, which LLVM vectorized and unrolled step by step (most
of a BatchNorm-heavy CNN's object-code time). A kernel with several outputs (a ``split``, a
gradient returned beside its input's) gets a loop nest per output, and so does a block whose
inlined expression would grow past :mod:`.inline_budget`'s budget.

``Elementwise(fuse=False)``, tried after the fused rule, keeps each output's loops as they are
(the outermost parallel, the innermost vectorized): the fused schedule is refused where
``FlattenBuffer`` would miscompile it (:mod:`.flatten_hazard`), which left such a kernel serial,
every block a loop of its own.
"""

from __future__ import annotations

import math

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block, normalize_prim_func
from tvm.s_tir.dlight.base import get_extent
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width

from .inline_budget import kept_as_blocks
from .shared_kernels import largest_tensor
from .vector_tails import split_into_vectors, with_tail_predicates

_MIN_PARALLEL = 4096  # below this many elements a kernel stays serial (thread start-up dominates)
_BROADCAST_RATIO = 8  # an elementwise block this many times smaller than the kernel's output stays a block


def vector_lanes(target: Target, sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int:
    bits = llvm_get_vector_width(target)
    stmt = sch.get(block)
    dtype_bits = stmt.writes[0].source.dtype.bits if stmt.writes else 32
    return max((bits if bits > 0 else 128) // dtype_bits, 2)


def _static_product(extents) -> int | None:
    """The product of extents known at compile time; None if one is symbolic."""
    values = [int(e) if isinstance(e, (int, tirx.IntImm)) else None for e in extents]
    known = [v for v in values if v is not None]
    return math.prod(known) if len(known) == len(values) else None


def static_numel(sch: s_tir.Schedule, loops: list) -> int | None:
    return _static_product(get_extent(sch, loop) for loop in loops)


class Elementwise(CPUScheduleRule):
    """All-injective kernels: a loop nest per output, parallel outside, vectorized inside; with
    ``fuse`` (the default) each output's loops are fused first."""

    def __init__(self, fuse: bool = True) -> None:
        self.fuse = fuse

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(i.is_injective() for i in infos):
            return None
        outputs = _output_blocks(sch, infos)
        if not outputs:
            return None
        names = {sch.get(o).name_hint for o in outputs}
        kept = kept_as_blocks(sch, [i.block_rv for i in infos], names)
        # a kept block is a loop nest of its own, before the outputs that read it
        nests = [i.block_rv for i in infos if sch.get(i.block_rv).name_hint in kept | names]
        broadcasts = _inline_into_outputs(sch, infos, outputs, kept)
        if broadcasts is None:
            return None
        bound = largest_tensor(func)
        small = bound is not None and bound < _MIN_PARALLEL  # a symbolic size known to be small
        partial: list[str] = []  # outputs whose last vector is partial
        if len(nests) == 1:
            if not _schedule_output(sch, target, nests[0], broadcasts, self.fuse, small, partial):
                return None
        else:
            for block in nests:
                _schedule_output(sch, target, block, [], self.fuse, small, partial)
        return with_tail_predicates(sch, partial) if partial else sch


def _output_blocks(sch: s_tir.Schedule, infos: list) -> list[s_tir.schedule.SBlockRV]:
    """The blocks that write a buffer the kernel does not allocate (one of its outputs), in
    program order."""
    local = list(sch.get(get_root_block(sch)).alloc_buffers)
    return [
        i.block_rv
        for i in infos
        if any(not any(w.source.same_as(b) for b in local) for w in sch.get(i.block_rv).writes)
    ]


def _inline_into_outputs(sch: s_tir.Schedule, infos: list, outputs: list, kept: set[str]) -> list | None:
    """Every other block inlined into its consumers, except broadcast operands (returned, each
    chain of them inlined into its last link) and the ``kept`` blocks (too large to copy into
    their readers: :mod:`.inline_budget`); None where a block cannot be inlined."""
    names = {sch.get(o).name_hint for o in outputs} | kept
    sizes = [static_numel(sch, sch.get_loops(o)) for o in outputs]
    total = max(s for s in sizes if s is not None) if all(s is not None for s in sizes) else None
    broadcasts: list[s_tir.schedule.SBlockRV] = []
    for info in infos:
        if sch.get(info.block_rv).name_hint in names:
            continue
        size = static_numel(sch, sch.get_loops(info.block_rv))
        if total is not None and size is not None and size * _BROADCAST_RATIO <= total:
            broadcasts.append(info.block_rv)  # a row's log-sum-exp: computed once, not per element
            continue
        try:
            sch.compute_inline(info.block_rv)
        except s_tir.ScheduleError:
            return None
    return _inline_broadcast_chains(sch, broadcasts)


def _inline_broadcast_chains(sch: s_tir.Schedule, broadcasts: list) -> list:
    """``broadcasts`` less those read only by other broadcasts of their own size, each inlined
    into its readers (BatchNorm's ``invstd`` into its scale and shift): the per-channel work is
    the same few operations, in a loop per operand instead of a loop per step."""
    size = {sch.get(b).name_hint: static_numel(sch, sch.get_loops(b)) for b in broadcasts}
    kept = []
    for block in broadcasts:
        own = size[sch.get(block).name_hint]
        readers = [sch.get(c).name_hint for c in sch.get_consumers(block)]
        if own is not None and readers and all(size.get(r) == own for r in readers):
            try:
                sch.compute_inline(block)
                continue
            except s_tir.ScheduleError:
                pass
        kept.append(block)
    return kept


def _schedule_output(
    sch: s_tir.Schedule,
    target: Target,
    block: s_tir.schedule.SBlockRV,
    broadcasts: list,
    fuse: bool,
    small: bool = False,
    partial: list[str] | None = None,
) -> bool:
    """One output block's loops parallel and vectorized (fused first with ``fuse``); False if it
    has no loops. ``small``: sizes symbolic but bounded below :data:`_MIN_PARALLEL` (a shared
    kernel's members), so serial as a static kernel of that size is: a parallel launch costs a
    few microseconds, more than such a kernel's work."""
    loops = sch.get_loops(block)
    if not loops:
        return False
    n = static_numel(sch, loops)
    lanes = vector_lanes(target, sch, block)
    if not fuse:
        _schedule_unfused(sch, block, loops, n, lanes, small)
        return True
    if selects_between_reads(sch, block) or _low_precision_broadcast(sch, block):  # parallel, never vectorized
        if n is None:
            _parallel_rows(sch, loops, not small)
            return True
        outer = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        if n >= _MIN_PARALLEL:
            sch.parallel(outer)
        return True
    if n is None:  # a symbolic size: serve every size, parallel over all but a static inner axis
        _schedule_symbolic_elementwise(sch, block, loops, lanes, not small)
        return True
    inner_extent = get_extent(sch, loops[-1])
    tiled = _tile_transpose(sch, block, loops, lanes)
    if tiled is not None:
        if n >= _MIN_PARALLEL:
            sch.parallel(tiled)
        return True
    cut = False  # a partial last vector
    if len(loops) > 1 and isinstance(inner_extent, int) and inner_extent >= 4 * lanes:
        # keep the innermost axis for contiguous vectors, parallelize the rest
        outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        cut = split_into_vectors(sch, loops[-1], lanes)[1]
        _compute_at_rows(sch, block, broadcasts, outer)
    else:
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        if n >= 2 * lanes:
            outer, cut = split_into_vectors(sch, fused, lanes)
        else:
            outer = fused
    if cut and partial is not None:
        partial.append(sch.get(block).name_hint)
    if n >= _MIN_PARALLEL:
        sch.parallel(outer)
    return True


def _schedule_unfused(sch: s_tir.Schedule, block, loops: list, n: int | None, lanes: int, small: bool) -> None:
    """The outermost loop parallel, the innermost split into vectors where it divides into them
    (no loop fused: a split binds ``outer * lanes + lane``, with no division to flatten)."""
    inner = get_extent(sch, loops[-1])
    vectorize = not (selects_between_reads(sch, block) or _low_precision_broadcast(sch, block))
    if vectorize and isinstance(inner, int) and inner % lanes == 0 and inner >= 2 * lanes:
        split_outer, vec = sch.split(loops[-1], factors=[None, lanes])
        sch.vectorize(vec)
        loops = [*loops[:-1], split_outer]
    if (n is None and not small) or (n is not None and n >= _MIN_PARALLEL):
        sch.parallel(loops[0])


def _compute_at_rows(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, broadcasts: list[s_tir.schedule.SBlockRV], rows
) -> None:
    """Each per-row operand of ``block`` computed inside its row loop ``rows`` (its leading axes,
    fused), for the row it serves (a LayerNorm gradient's row scale): in parallel with the rows and
    while they are in cache, instead of a serial loop over all rows before them, which LLVM also
    unrolls in full (most of such a kernel's code generation time). Only operands each row reads
    a part of its own (indexed by every leading axis) move; a column operand (a cast bias, read
    whole by every row) stays before the loop, computed once. (A per-row operand's own per-row
    producers were inlined into it before: :func:`_inline_broadcast_chains`.) One that cannot move
    stays where it was (still correct)."""
    lead = [iv.var for iv in sch.get(block).iter_vars[:-1]]
    for producer in broadcasts:
        written = sch.get(producer).writes[0].source
        if not _read_per_row(sch.get(block), written, lead):
            continue
        try:
            sch.compute_at(producer, rows, preserve_unit_loops=False)
        except s_tir.ScheduleError:
            continue


def _read_per_row(stmt: s_tir.SBlock, buffer: tirx.Buffer, lead: list[tirx.Var]) -> bool:
    """Whether ``stmt`` reads ``buffer`` only at indices that use every one of its leading axes
    (each row its own part)."""
    regions = [read.region for read in stmt.reads if read.source.same_as(buffer)]
    return bool(lead and regions) and all(
        all(any(u.same_as(v) for r in region for u in tirx.analysis.undefined_vars(r.min)) for v in lead)
        for region in regions
    )


def selects_between_reads(sch: s_tir.Schedule, block) -> bool:
    """Whether ``block`` chooses between reads with ``if_then_else`` (a concatenation, a pad, a
    shifted copy, once inlined). TVM 0.27 vectorizes such a block wrongly when the condition
    varies across the lanes: a RoPE gradient (``split``, ``concatenate``, ``transpose``, 16 lanes
    over rows of 8) came out off by 1e29. Those kernels are copies bound by memory, so they stay
    scalar (and parallel)."""
    return "if_then_else" in str(sch.get(block))


def _low_precision_broadcast(sch: s_tir.Schedule, block) -> bool:
    """Whether ``block``'s value holds a bfloat16/float16 scalar, the same in every lane along its
    innermost axis (an ``expand``, a constant fill, a zero gradient's ``bfloat16(0)``): vectorized,
    it is broadcast, which TVM 0.27's bfloat16 storage legalization leaves in bfloat16 while the
    buffer becomes uint16 ("dtype mismatch on BufferStore"). Such kernels stay scalar."""
    stmt = sch.get(block)
    store, inner = stmt.body, stmt.iter_vars[-1].var
    if not isinstance(store, tirx.BufferStore):
        return False
    found: list[tirx.PrimExpr] = []

    def check(node: tirx.PrimExpr) -> tirx.PrimExpr:
        if str(node.ty.dtype) in ("bfloat16", "float16") and not any(
            v.same_as(inner) for v in tirx.analysis.undefined_vars(node)
        ):
            found.append(node)
        return node

    check(store.value)
    tvm_ffi.structural_map(store.value, [((tirx.FloatImm, tirx.Cast), check)])
    return bool(found)


def _tile_transpose(sch: s_tir.Schedule, block, loops: list, lanes: int):
    """If ``block`` is a transpose (its innermost loop does not index the contiguous axis of its
    largest input, another loop does), tile both loops by ``lanes``: loops become
    ``[rest, col_o, row_o, col_i, row_i (vector)]``; the fused outer loops are returned for
    parallelizing. None (schedule untouched) if the block is not such a transpose."""
    stmt = sch.get(block)
    if len(loops) < 2 or len(loops) != len(stmt.iter_vars):
        return None
    reads = [r for r in stmt.reads if len(r.region) >= 2]
    if not reads:
        return None
    big = max(reads, key=lambda r: _static_product(r.source.shape) or 0)
    last_index_vars = tirx.analysis.undefined_vars(big.region[-1].min)
    used = [any(iv.var.same_as(v) for v in last_index_vars) for iv in stmt.iter_vars]
    if not any(used) or used[-1]:
        return None
    col = max(i for i, u in enumerate(used) if u)  # innermost loop the input is contiguous in
    row_extent, col_extent = get_extent(sch, loops[-1]), get_extent(sch, loops[col])
    if not (isinstance(row_extent, int) and isinstance(col_extent, int)):
        return None
    if row_extent % lanes or col_extent % lanes:
        return None
    rest = [lp for i, lp in enumerate(loops) if i not in (col, len(loops) - 1)]
    col_o, col_i = sch.split(loops[col], factors=[None, lanes])
    row_o, row_i = sch.split(loops[-1], factors=[None, lanes])
    sch.reorder(*rest, col_o, row_o, col_i, row_i)
    sch.vectorize(row_i)
    return sch.fuse(*rest, col_o, row_o)


def _schedule_symbolic_elementwise(
    sch: s_tir.Schedule, block, loops: list, lanes: int, parallel: bool = True
) -> s_tir.Schedule:
    """An elementwise kernel whose size is symbolic (``parallel`` unless known to be small): its
    trailing static axes fused (a shared CNN kernel's ``(2, C, 8, 8)``: 64 elements per channel)
    and vectorized where they divide into vectors."""
    static = 0
    while static < len(loops) - 1 and isinstance(get_extent(sch, loops[-1 - static]), int):
        static += 1
    if static:
        inner_loops = loops[len(loops) - static :]
        inner = sch.fuse(*inner_loops) if static > 1 else inner_loops[0]
        extent = get_extent(sch, inner)
        outer_loops = loops[: len(loops) - static]
        outer = sch.fuse(*outer_loops) if len(outer_loops) > 1 else outer_loops[0]
        if extent % lanes == 0 and extent >= 2 * lanes:
            _, vec = sch.split(inner, factors=[None, lanes])
            sch.vectorize(vec)
    else:
        return _parallel_rows(sch, loops, parallel)
    if parallel:
        sch.parallel(outer)
    return sch


def _parallel_rows(sch: s_tir.Schedule, loops: list, parallel: bool = True) -> s_tir.Schedule:
    """Every loop but the innermost fused and parallel (unless not ``parallel``); the innermost, of
    a symbolic extent, left a plain loop (LLVM vectorizes it with a scalar tail). Fused with the
    others it would bind its index by a division and a remainder by symbolic sizes at every
    element: a shared kernel's copy ran at a tenth of the speed of memory."""
    outer = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    if parallel:
        sch.parallel(outer)
    return sch
