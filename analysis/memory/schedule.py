"""Orders of a DataflowGraph that lower peak memory: heuristics, an exact ILP and window search.

`optimal_order` starts from the best of three orders: the program's own, `optimizer_rewrite`
(each parameter update right after its gradient) and `greedy_order` (the ready node that frees
the most bytes net). Every order is first put in the reduced form of ``problem`` (nodes that
allocate nothing run as soon as they can, which never raises the peak), and its peak is checked
against `ScheduleProblem.lower_bound` (what must be live while each node runs, in any order).
If the gap is not closed, the ILP of ``ilp`` (time windows from ASAP/ALAP, the best order as
HiGHS's warm start, symmetry breaking) runs on the whole reduced graph; a graph whose windows
exceed the column cap gets windows cut to a band around the warm start (then it proves nothing),
and window search (the same ILP over consecutive steps around the peak, every other node
fixed) uses the time left. The result is never worse than any of the three starting orders, and
every order returned has been checked to be topological.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from analysis.memory.dataflow import BACKWARD, OPTIMIZER, OUTPUT, DataflowGraph, GraphError
from analysis.memory.ilp import ILPSolution, OrderILP, column_count, reduced_deps, twins
from analysis.memory.problem import ScheduleProblem, reduce_graph
from analysis.memory.simulate import simulate


@dataclass
class ScheduleResult:
    """Best order found, its simulated peak, and whether it is proved optimal (by HiGHS or by
    reaching the lower bound, within the relative gap asked for)."""

    order: list[str]
    peak: int
    optimal: bool
    method: str  # "ilp", "lns", or the starting order that won
    solve_time: float
    lower_bound: int | None = None  # proven bound on the optimal peak (bytes), if any
    log: list[str] = field(default_factory=list)
    baselines: dict[str, int] = field(default_factory=dict)  # peaks of the starting orders

    @property
    def gap(self) -> float | None:
        """(peak - lower bound) / peak: how far from optimal the order can still be."""
        if self.lower_bound is None or self.peak <= 0:
            return None
        return max(0.0, (self.peak - self.lower_bound) / self.peak)


# ---- heuristics -------------------------------------------------------------------------------
def optimizer_rewrite(graph: DataflowGraph, order: Sequence[str] | None = None) -> list[str]:
    """Move each parameter's optimizer update right after its gradient is produced.

    Optimizer nodes that depend on a backward node go right after the last non-optimizer node
    they depend on; the other optimizer nodes (state-only work) go just before their first
    optimizer consumer. Everything else keeps its place, so gradients die early.
    """
    order = [n for n in (order or graph.program_order()) if not graph.nodes[n].resident]
    pos = {n: i for i, n in enumerate(order)}
    pred = graph.predecessors()
    succ = graph.successors()
    kind = {n: graph.nodes[n].kind for n in order}
    grad_dep: dict[str, bool] = {}
    last_dep: dict[str, int] = {}  # latest position of a non-optimizer ancestor
    for n in order:
        ps = [p for p in pred[n] if p in pos]
        grad_dep[n] = kind[n] == BACKWARD or any(grad_dep[p] for p in ps)
        last_dep[n] = max((pos[p] if kind[p] != OPTIMIZER else last_dep[p] for p in ps), default=-1)
    key: dict[str, float] = {}
    for n in reversed(order):
        if kind[n] != OPTIMIZER:
            key[n] = pos[n]
        elif grad_dep[n]:
            key[n] = last_dep[n] + 0.5
        else:
            consumers = [key[s] for s in succ[n] if s in pos and kind[s] == OPTIMIZER]
            key[n] = min(consumers) if consumers else pos[n]
    new = sorted(order, key=lambda n: (key[n], pos[n]))
    graph.check_order(new)
    return new


def _keeps(graph: DataflowGraph, e_name: str) -> bool:
    e = graph.edges[e_name]
    return e.is_output or any(graph.nodes[s].kind == OUTPUT for s in e.sinks)


def greedy_order(graph: DataflowGraph) -> list[str]:
    """Run, among the ready nodes, the one that frees the most bytes net: inputs it is the last
    reader of, minus outputs that outlive its step (ties: program order). OUTPUT nodes last."""
    order = [n for n in graph.program_order() if not graph.nodes[n].resident]
    outputs = [n for n in order if graph.nodes[n].kind == OUTPUT]
    ops = [n for n in order if graph.nodes[n].kind != OUTPUT]
    pos = {n: i for i, n in enumerate(ops)}
    left = {
        e.name: sum(s in pos for s in e.sinks)
        for e in graph.memory_edges()
        if e.src in pos and not _keeps(graph, e.name)
    }
    waiting = {n: sum(p in pos for p in ps) for n, ps in graph.predecessors().items() if n in pos}
    succ = graph.successors()

    def score(v: str) -> int:
        node = graph.nodes[v]
        freed = sum(graph.edges[e].size for e in node.inputs if left.get(e) == 1)
        made = sum(graph.edges[e].size for e in node.outputs if graph.edges[e].sinks or _keeps(graph, e))
        return freed - made

    heap = [(-score(n), pos[n], n) for n in ops if waiting[n] == 0]
    heapq.heapify(heap)
    done: set[str] = set()
    out: list[str] = []
    while heap:
        neg, _, v = heapq.heappop(heap)
        if v in done or -neg != score(v):
            continue  # stale: a fresher entry is in the heap
        done.add(v)
        out.append(v)
        for e in graph.nodes[v].inputs:
            if e in left:
                left[e] -= 1
                rest = [s for s in graph.edges[e].sinks if s in pos and s not in done]
                if left[e] == 1 and rest and waiting[rest[0]] == 0:
                    heapq.heappush(heap, (-score(rest[0]), pos[rest[0]], rest[0]))
        for s in succ[v]:
            if s in waiting:
                waiting[s] -= 1
                if waiting[s] == 0:
                    heapq.heappush(heap, (-score(s), pos[s], s))
    if len(out) != len(ops):
        raise GraphError("greedy_order: the graph has a cycle")
    graph.check_order(out + outputs)
    return out + outputs


# ---- the ILP on the reduced problem -------------------------------------------------------------
# D columns above which the windows are cut to a band around the warm start: Python builds about
# 30k columns a second here, and HiGHS needs the rest of a minute's budget for them
ILP_MAX_COLUMNS = 150_000


def band_windows(
    win: Sequence[tuple[int, int]], start: Sequence[int], max_cols: int
) -> tuple[list[tuple[int, int]], int | None]:
    """Windows cut to [pos - band, pos + band] around order `start`, with the widest band that
    keeps `max_cols` D columns (band None: the windows fit as they are)."""
    if column_count(win) <= max_cols:
        return list(win), None
    pos = {v: t for t, v in enumerate(start)}

    def cut(band: int) -> list[tuple[int, int]]:
        return [(max(lo, pos[v] - band), min(hi, pos[v] + band)) for v, (lo, hi) in enumerate(win)]

    lo_b, hi_b = 0, max(hi - lo for lo, hi in win)
    while lo_b < hi_b:  # the largest band under the cap
        mid = (lo_b + hi_b + 1) // 2
        lo_b, hi_b = (mid, hi_b) if column_count(cut(mid)) <= max_cols else (lo_b, mid - 1)
    return cut(lo_b), lo_b


def solve_problem(
    prob: ScheduleProblem,
    start: Sequence[int],
    time_limit: float,
    mip_rel_gap: float = 1e-4,
    max_cols: int = ILP_MAX_COLUMNS,
    lower: int | None = None,
) -> tuple[ILPSolution, int | None]:
    """The whole ILP over `prob` from the warm start `start`; returns the solution and the band
    its windows were cut to (None: full ASAP/ALAP windows, so HiGHS's bound is a proof).
    Building the model counts against `time_limit`."""
    t0 = time.perf_counter()
    anc, desc = prob.reach()
    win, band = band_windows(prob.windows(), start, max_cols)
    T = len(prob)
    ilp = OrderILP(prob, win, range(T), [float(prob.resident)] * T, range(len(prob.tensors)), desc)
    ilp.build(reduced_deps(prob, anc), twins(prob, desc) if band is None else [])
    peak0 = prob.peak(start)
    left = max(MIN_SOLVE_SECONDS / 2, time_limit - (time.perf_counter() - t0))
    sol = ilp.solve(left, mip_rel_gap, start, peak_lb=float(lower or 0), peak_ub=peak0 * (1 + 1e-9) + 1)
    return sol, band


def _as_result(
    graph: DataflowGraph, prob: ScheduleProblem, order: Sequence[int], method: str, t0: float, **kw
) -> ScheduleResult:
    full = prob.expand(order)
    graph.check_order(full)
    return ScheduleResult(full, simulate(graph, full).peak, method=method, solve_time=time.perf_counter() - t0, **kw)


def ilp_order(
    graph: DataflowGraph,
    time_limit: float = 60.0,
    mip_rel_gap: float = 1e-4,
    order: Sequence[str] | None = None,
    start: Sequence[str] | None = None,
    max_cols: int = ILP_MAX_COLUMNS,
) -> ScheduleResult:
    """The whole-graph ILP, warm-started from `start` (default: the better of the program
    order and the greedy order). Raises GraphError if HiGHS returned no order."""
    t0 = time.perf_counter()
    prob = reduce_graph(graph, order)
    if start is None:
        start = min([graph.program_order(), greedy_order(graph)], key=lambda o: prob.peak(prob.project(o)))
    lower = prob.lower_bound(prob.project(start))
    sol, band = solve_problem(prob, prob.project(start), time_limit, mip_rel_gap, max_cols, lower)
    if sol.order is None:
        raise GraphError(f"ILP found no order: {sol.message}")
    proved = band is None and sol.optimal
    bounds = [b for b in (lower, _proof(sol.bound, band)) if b is not None]
    res = _as_result(
        graph,
        prob,
        sol.order,
        "ilp",
        t0,
        optimal=proved,
        lower_bound=max(bounds, default=None),
        log=[sol.message + ("" if band is None else f", windows cut to +-{band}")],
    )
    if proved:
        res.lower_bound = max(res.lower_bound or 0, int(res.peak * (1 - mip_rel_gap)))
    return res


def _proof(bound: float | None, band: int | None) -> int | None:
    """HiGHS's dual bound as bytes no order can beat (none from a banded model), rounded down
    past the solver's tolerances."""
    return None if bound is None or band is not None else int(bound * (1 - 1e-6))


# ---- window search ------------------------------------------------------------------------------
PEAK_POSITIONS = (0.5, 0.2, 0.8)  # where a peak step sits in a candidate window (fraction of it)
WINDOW_SHRINK = 0.7  # a sub-problem not solved to optimality shrinks the window by this factor
WINDOW_GROW = 1.25  # one solved within FAST_SOLVE of its time limit grows it by this factor
FAST_SOLVE = 0.25
MIN_WINDOW = 8
MAX_WINDOW_GROWTH = 4  # the window never grows past this many times the one asked for
SUB_LIMIT_SHARE = 1 / 8  # default seconds per sub-problem: this share of the time limit ...
SUB_LIMIT_RANGE = (2.0, 10.0)  # ... clipped to this range
MIN_SOLVE_SECONDS = 1.0  # less time than this left: stop


def _candidate_windows(mem: list[int], window: int, tried: set[tuple[int, int]]) -> list[tuple[int, int]]:
    T = len(mem)
    cands = []
    for t in (t for t in range(T) if mem[t] == max(mem)):
        for shift in PEAK_POSITIONS:
            a = max(0, min(T - window, int(t - window * shift)))
            cands.append((a, min(T, a + window)))
    return [c for c in dict.fromkeys(cands) if c not in tried]


def _window_ilp(
    prob: ScheduleProblem, cur: list[int], mem: list[int], a: int, b: int, reach: tuple[list[int], list[int]]
) -> OrderILP:
    """Steps [a, b) of `cur` free (windows from their order inside the segment), every other
    node fixed; tensors that no segment node makes or waits on are a constant."""
    anc, desc = reach
    seg = set(cur[a:b])
    mask = sum(1 << v for v in seg)
    pos = {v: t for t, v in enumerate(cur)}
    win = [(pos[v], pos[v]) for v in range(len(prob))]
    for v in seg:
        win[v] = (a + (anc[v] & mask).bit_count(), b - 1 - (desc[v] & mask).bit_count())
    touching = [i for i, e in enumerate(prob.tensors) if e.src in seg or any(s in seg for s in e.sinks)]
    const = np.asarray(mem[a:b], dtype=float)
    T = len(cur)
    for i in touching:
        e = prob.tensors[i]
        lo = pos[e.src]
        hi = T - 1 if e.to_end else max([lo] + [pos[s] for s in e.sinks])
        const[max(lo, a) - a : max(min(hi, b - 1) - a + 1, 0)] -= e.size
    ilp = OrderILP(prob, win, range(a, b), const.tolist(), touching, desc)
    ilp.build([(u, w) for u, w in reduced_deps(prob, anc) if u in seg and w in seg], [])
    return ilp


def _lns(
    prob: ScheduleProblem,
    start: list[int],
    time_limit: float,
    window: int,
    sub_limit: float,
    gap: float,
    log: list[str],
) -> list[int]:
    """Window search from `start` (see `lns_improve`); returns the best order."""
    t0 = time.perf_counter()
    reach = prob.reach()
    cur, mem = list(start), prob.memory(start)
    tried: set[tuple[int, int]] = set()
    max_window = MAX_WINDOW_GROWTH * window
    while time.perf_counter() - t0 < time_limit:
        cands = _candidate_windows(mem, window, tried)
        left = min(sub_limit, time_limit - (time.perf_counter() - t0))
        if not cands or left < MIN_SOLVE_SECONDS:
            break
        tried.add(cands[0])
        t_sub = time.perf_counter()
        sol = _window_ilp(prob, cur, mem, *cands[0], reach).solve(left, gap, cur)
        if sol.order is None or not sol.optimal:  # too hard at this size: shrink the window
            window = max(MIN_WINDOW, int(window * WINDOW_SHRINK))
        elif time.perf_counter() - t_sub < sub_limit * FAST_SOLVE:
            window = min(max_window, int(window * WINDOW_GROW) + 1)
        if sol.order is None:
            continue
        new_mem = prob.memory(sol.order)
        if sorted(new_mem, reverse=True) < sorted(mem, reverse=True):
            log.append(f"window [{cands[0][0]},{cands[0][1]}): peak {max(mem)} -> {max(new_mem)}")
            cur, mem = sol.order, new_mem
            tried.clear()
    return cur


def lns_improve(
    graph: DataflowGraph,
    order: Sequence[str],
    time_limit: float = 60.0,
    window: int = 40,
    sub_limit: float | None = None,
    mip_rel_gap: float = 1e-4,
) -> ScheduleResult:
    """Re-solve the ILP over `window` consecutive steps (of the reduced problem) around the
    peak, every other node fixed, each from the current order as warm start.

    A new order is taken when its memory profile, sorted from high to low, is lexicographically
    smaller (so the peak never rises and the search cannot cycle). The window shrinks when a
    sub-problem is not solved in `sub_limit` seconds and grows when it is solved fast. Stops
    when time is up or no window around any peak step improves.
    """
    t0 = time.perf_counter()
    if sub_limit is None:
        sub_limit = max(SUB_LIMIT_RANGE[0], min(SUB_LIMIT_RANGE[1], time_limit * SUB_LIMIT_SHARE))
    prob = reduce_graph(graph)
    log: list[str] = []
    best = _lns(prob, prob.project(order), time_limit, window, sub_limit, mip_rel_gap, log)
    return _as_result(graph, prob, best, "lns", t0, optimal=False, log=log)


# ---- everything together --------------------------------------------------------------------------
def _closed(peak: int, lower: int | None, gap: float) -> bool:
    return lower is not None and peak - lower <= gap * peak


def starting_orders(graph: DataflowGraph) -> dict[str, list[str]]:
    """The program order, the optimizer rewrite and the greedy order."""
    return {"program": graph.program_order(), "rewrite": optimizer_rewrite(graph), "greedy": greedy_order(graph)}


def optimal_order(
    graph: DataflowGraph,
    time_limit: float = 60.0,
    mip_rel_gap: float = 1e-4,
    max_ilp_cols: int = ILP_MAX_COLUMNS,
    ilp_share: float = 0.6,
    lns_window: int = 40,
) -> ScheduleResult:
    """Lowest-peak order found within about `time_limit` seconds (module docstring).

    The whole ILP gets `ilp_share` of the time, window search the rest unless the ILP proved
    optimality. `optimal` is True when the peak is within `mip_rel_gap` of a proven lower bound.
    `baselines` holds the peaks of the three starting orders as given (before reduction)."""
    t0 = time.perf_counter()
    prob = reduce_graph(graph)
    starts = starting_orders(graph)
    baselines = {k: simulate(graph, o).peak for k, o in starts.items()}
    proj = {k: prob.project(o) for k, o in starts.items()}
    method = min(proj, key=lambda k: prob.peak(proj[k]))
    best = proj[method]
    lower = prob.lower_bound(best)
    log = [f"lower bound {lower} bytes, {method} order {prob.peak(best)}"]
    proved = _closed(prob.peak(best), lower, mip_rel_gap)
    if not proved:
        sol, band = solve_problem(prob, best, time_limit * ilp_share, mip_rel_gap, max_ilp_cols, lower)
        log.append(sol.message + ("" if band is None else f", windows cut to +-{band}"))
        if sol.order is not None and prob.peak(sol.order) < prob.peak(best):
            best, method = sol.order, "ilp"
        proved = band is None and sol.optimal
        lower = max([b for b in (lower, _proof(sol.bound, band)) if b is not None], default=None)
    left = time_limit - (time.perf_counter() - t0)
    if not proved and not _closed(prob.peak(best), lower, mip_rel_gap) and left >= MIN_SOLVE_SECONDS:
        sub = max(SUB_LIMIT_RANGE[0], min(SUB_LIMIT_RANGE[1], time_limit * SUB_LIMIT_SHARE))
        found = _lns(prob, best, left, lns_window, sub, mip_rel_gap, log)
        if prob.peak(found) < prob.peak(best):
            best, method = found, "lns"
    res = _as_result(graph, prob, best, method, t0, optimal=False, lower_bound=lower, log=log, baselines=baselines)
    return _finish(graph, res, starts, proved, mip_rel_gap, t0)


def _finish(
    graph: DataflowGraph, res: ScheduleResult, starts: dict[str, list[str]], proved: bool, gap: float, t0: float
) -> ScheduleResult:
    """Never return worse than a starting order; mark optimality; time the whole search."""
    for name, order in starts.items():
        if res.baselines[name] < res.peak:  # cannot happen (reduction never raises a peak)
            res.order, res.peak, res.method = list(order), res.baselines[name], name
    if proved and res.lower_bound is not None:
        res.lower_bound = max(res.lower_bound, int(res.peak * (1 - gap)))
    res.optimal = proved or _closed(res.peak, res.lower_bound, gap)
    graph.check_order(res.order)
    res.solve_time = time.perf_counter() - t0
    return res
