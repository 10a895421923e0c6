"""Orders of a DataflowGraph that lower peak memory: an exact ILP (OLLA-style) and a rewrite.

ILP (one node per time step, T = number of op nodes), after Steiner et al., "OLLA: Optimizing
the Lifetime and Location of Arrays" (2022), restricted to each node's [ASAP, ALAP] window:
  R[v,t] in {0,1}   node v runs at step t (its outputs are created then);
  P[e,t] in [0,1]   tensor e is kept (preserved) at step t; continuous is exact because with
                    integral R the cheapest feasible P is the 0/1 liveness;
  D[v,t]            v has run by step t (= sum R[v,<=t]), used for ordering constraints;
  sum_t R[v,t] = 1; sum_v R[v,t] = 1; P[e,t] <= P[e,t-1] + R[src,t-1] (made once, kept since);
  R[w,t] <= P[e,t] for every input e of w (inputs resident); graph outputs are kept to the end;
  D[w,t] <= D[u,t-1] for every dependency u -> w; memory(t) = const(t) + sum size(R + P) <= peak.
Solved by HiGHS through scipy.optimize.milp with a time limit and a relative gap. Graphs too big
for the whole ILP are improved by large-neighbourhood search: the same ILP over a window of
consecutive steps around the current peak, every other node fixed, repeated until time is up.
Every order returned here has been checked to be topological.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import LinearConstraint, milp
from scipy.sparse import coo_matrix

from analysis.memory.dataflow import BACKWARD, OPTIMIZER, OUTPUT, DataflowGraph, GraphError
from analysis.memory.simulate import lifetimes, simulate


@dataclass
class ScheduleResult:
    """Best order found, its simulated peak, and whether the ILP proved it optimal."""

    order: list[str]
    peak: int
    optimal: bool
    method: str                       # "ilp", "lns", or the heuristic that won
    solve_time: float
    lower_bound: int | None = None    # proven bound on the optimal peak (bytes), if any
    log: list[str] = field(default_factory=list)


# ---- the cheap rewrite -------------------------------------------------------------------
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
    last_dep: dict[str, int] = {}    # latest position of a non-optimizer ancestor
    for n in order:
        ps = [p for p in pred[n] if p in pos]
        grad_dep[n] = kind[n] == BACKWARD or any(grad_dep[p] for p in ps)
        last_dep[n] = max((pos[p] if kind[p] != OPTIMIZER else last_dep[p] for p in ps),
                          default=-1)
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


# ---- windows -------------------------------------------------------------------------------
def _deps(graph: DataflowGraph, ops: set[str]) -> list[tuple[str, str]]:
    pairs = {(e.src, s) for e in graph.edges.values() if e.src in ops for s in e.sinks if s in ops}
    return sorted(pairs)


def asap_alap(nodes: Sequence[str], deps: Sequence[tuple[str, str]], first: int = 0
              ) -> dict[str, tuple[int, int]]:
    """[ASAP, ALAP] step of each node with one node per step, steps first..first+len-1.

    ASAP = first + number of ancestors, ALAP = last - number of descendants (bit sets).
    `nodes` must be in a topological order.
    """
    idx = {n: i for i, n in enumerate(nodes)}
    pred: list[list[int]] = [[] for _ in nodes]
    succ: list[list[int]] = [[] for _ in nodes]
    for u, w in deps:
        if u in idx and w in idx:
            pred[idx[w]].append(idx[u])
            succ[idx[u]].append(idx[w])
    anc = [0] * len(nodes)
    for i in range(len(nodes)):
        for p in pred[i]:
            anc[i] |= anc[p] | (1 << p)
    desc = [0] * len(nodes)
    for i in reversed(range(len(nodes))):
        for s in succ[i]:
            desc[i] |= desc[s] | (1 << s)
    last = first + len(nodes) - 1
    return {n: (first + anc[i].bit_count(), last - desc[i].bit_count())
            for i, n in enumerate(nodes)}


# ---- the ILP -------------------------------------------------------------------------------
class _Model:
    """Sparse rows and columns for scipy.optimize.milp, built incrementally."""

    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integral: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.row_lb: list[float] = []
        self.row_ub: list[float] = []

    def var(self, integral: bool, lb: float = 0.0, ub: float = 1.0) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integral.append(int(integral))
        return len(self.lb) - 1

    def row(self, terms: dict[int, float], lo: float, hi: float) -> None:
        r = len(self.row_lb)
        for c, v in terms.items():
            if v:
                self.rows.append(r)
                self.cols.append(c)
                self.vals.append(v)
        self.row_lb.append(lo)
        self.row_ub.append(hi)


def _lin(*parts: tuple[float, int | float | None]) -> tuple[dict[int, float], float]:
    """Sum of coef * x, where x is a column index (int), a constant (float) or None (0)."""
    terms: dict[int, float] = {}
    const = 0.0
    for coef, x in parts:
        if isinstance(x, int) and not isinstance(x, bool):
            terms[x] = terms.get(x, 0.0) + coef
        elif x is not None:
            const += coef * float(x)
    return terms, const


def followers(graph: DataflowGraph, ops: Sequence[str], deps: Sequence[tuple[str, str]]
              ) -> dict[str, str]:
    """Nodes that can run right after their only predecessor without raising the peak.

    A node w that allocates nothing (views, in-place ops) and depends on one op node p only:
    moving w to just after p frees its inputs no later and w's step holds a subset of what p's
    step held, so some optimal order has w right after p. One follower per p (first in order).
    """
    opset = set(ops)
    pred: dict[str, list[str]] = {v: [] for v in ops}
    for u, w in deps:
        pred[w].append(u)
    out: dict[str, str] = {}
    taken: set[str] = set()
    for w in ops:
        node = graph.nodes[w]
        if node.kind == OUTPUT or len(pred[w]) != 1 or pred[w][0] in taken:
            continue
        if any(graph.edges[e].size > 0 for e in node.outputs):
            continue
        if pred[w][0] in opset:
            out[w] = pred[w][0]
            taken.add(pred[w][0])
    return out


@dataclass(frozen=True)
class _EdgeSpan:
    """Where tensor ``e`` can be alive: made in its source's window, kept until ``end_hi``, and
    certainly kept over ``(hi_s, end_lo]``."""

    lo_s: int
    hi_s: int
    end_lo: int
    end_hi: int
    keep: bool  # a graph output, or read by the output node: kept to the end


class _WindowILP:
    """The ILP of the module docstring over ``ops`` with windows ``win`` (a node with a one-step
    window is fixed), memory counted over ``steps``. Columns and rows are added in a fixed order,
    so the same problem gives HiGHS the same matrix."""

    def __init__(self, graph: DataflowGraph, ops: list[str], win: dict[str, tuple[int, int]],
                 steps: range, const_mem: dict[int, float], edges: list[str]) -> None:
        self.graph, self.ops, self.win = graph, ops, win
        self.outputs = {n for n in graph.nodes if graph.nodes[n].kind == OUTPUT}
        self.scale = float(max([graph.edges[e].size for e in edges] + [1]))
        self.m = _Model()
        self.R: dict[tuple[str, int], int] = {}
        self.D: dict[tuple[str, int], int] = {}
        self.mem_terms: dict[int, dict[int, float]] = {t: {} for t in steps}
        self.mem_const: dict[int, float] = {t: const_mem.get(t, 0.0) / self.scale for t in steps}

    # --- variables: R (runs at), D (has run by)
    def r(self, v: str, t: int) -> int | float | None:
        lo, hi = self.win[v]
        if lo == hi:
            return 1.0 if t == lo else None
        return self.R.get((v, t))

    def d(self, v: str, t: int) -> int | float | None:
        lo, hi = self.win[v]
        return None if t < lo else (1.0 if t >= hi else self.D[v, t])

    def add_schedule(self) -> None:
        """R and D columns, each node run once, one node per step."""
        for v in self.ops:
            lo, hi = self.win[v]
            if lo > hi:
                raise GraphError(f"empty window for {v!r}: [{lo}, {hi}]")
            if lo < hi:
                for t in range(lo, hi + 1):
                    self.R[v, t] = self.m.var(True)
                for t in range(lo, hi):
                    self.D[v, t] = self.m.var(False)
        for v in self.ops:
            lo, hi = self.win[v]
            if lo == hi:
                continue
            self.m.row({self.R[v, t]: 1.0 for t in range(lo, hi + 1)}, 1.0, 1.0)
            for t in range(lo, hi):  # D[v,t] - D[v,t-1] - R[v,t] = 0
                terms, c = _lin((1.0, self.D[v, t]), (-1.0, self.d(v, t - 1)), (-1.0, self.R[v, t]))
                self.m.row(terms, -c, -c)
        by_step: dict[int, list[str]] = {}
        for v in self.ops:
            lo, hi = self.win[v]
            for t in range(lo, hi + 1):
                by_step.setdefault(t, []).append(v)
        for t, vs in by_step.items():
            fixed = [v for v in vs if self.win[v][0] == self.win[v][1]]
            if len(fixed) > 1:
                raise GraphError(f"two fixed nodes at step {t}: {fixed[:2]}")
            terms, c = _lin(*((1.0, self.r(v, t)) for v in vs))
            if terms:
                self.m.row(terms, 1.0 - c, 1.0 - c)

    def add_order(self, deps: list[tuple[str, str]], follow: dict[str, str]) -> None:
        """Dependencies run first; a follower runs right after its predecessor."""
        win = self.win
        for u, w in deps:
            for t in range(win[w][0], min(win[w][1], win[u][1]) + 1):
                terms, c = _lin((1.0, self.d(w, t)), (-1.0, self.d(u, t - 1)))
                if terms:
                    self.m.row(terms, -math.inf, -c)
        for w, u in follow.items():
            for t in range(min(win[w][0], win[u][0] + 1), max(win[w][1], win[u][1] + 1) + 1):
                terms, c = _lin((1.0, self.r(w, t)), (-1.0, self.r(u, t - 1)))
                if terms:
                    self.m.row(terms, -c, -c)

    # --- memory: P (kept at) per tensor
    def _add_mem(self, t: int, size: float, x: int | float | None) -> None:
        if t not in self.mem_terms or x is None:
            return
        if isinstance(x, float):
            self.mem_const[t] += size * x
        else:
            self.mem_terms[t][x] = self.mem_terms[t].get(x, 0.0) + size

    def add_tensor(self, e_name: str) -> None:
        """Tensor ``e_name``: bytes while made and while kept; kept only once made; kept while a
        reader runs."""
        e = self.graph.edges[e_name]
        size = e.size / self.scale
        sinks = [w for w in e.sinks if w not in self.outputs]
        lo_s, hi_s = self.win[e.src]
        for t in range(lo_s, hi_s + 1):
            self._add_mem(t, size, self.r(e.src, t))
        keep = e.is_output or len(sinks) < len(e.sinks)
        if not sinks and not keep:
            return
        last = len(self.ops) - 1
        span = _EdgeSpan(lo_s, hi_s, last if keep else max(self.win[w][0] for w in sinks),
                         last if keep else max(self.win[w][1] for w in sinks), keep)
        P = {t: self.m.var(False) for t in range(lo_s + 1, span.end_hi + 1) if not (hi_s < t <= span.end_lo)}
        for t in range(lo_s + 1, span.end_hi + 1):  # kept at t only if kept or made at t - 1
            terms, c = _lin((1.0, _kept(P, span, t)), (-1.0, _kept(P, span, t - 1)), (-1.0, self.r(e.src, t - 1)))
            if terms:
                self.m.row(terms, -math.inf if not keep else -c, -c)
        for t in range(lo_s + 1, span.end_hi + 1):
            self._add_mem(t, size, _kept(P, span, t))
        for w in sinks:
            for t in range(self.win[w][0], self.win[w][1] + 1):
                self._reader_needs(w, t, _kept(P, span, t), e_name)

    def _reader_needs(self, w: str, t: int, kept: int | float | None, e_name: str) -> None:
        """If ``w`` runs at ``t`` its input must be kept at ``t``."""
        rw = self.r(w, t)
        if rw is None or (isinstance(kept, float) and kept == 1.0):  # (a column index may be 1)
            return
        if kept is None:
            if not isinstance(rw, int):
                raise GraphError(f"{w!r} fixed at step {t} before its input {e_name!r}")
            self.m.ub[rw] = 0.0
            return
        terms, c = _lin((1.0, rw), (-1.0, kept))
        self.m.row(terms, -math.inf, -c)

    # --- objective and solve
    def solve(self, time_limit: float, gap: float) -> tuple[list[str] | None, bool, float | None, str]:
        m = self.m
        peak = m.var(False, 0.0, math.inf)
        m.lb[peak] = max(self.mem_const.values(), default=0.0)
        for t, mem in self.mem_terms.items():
            if mem:
                m.row({**mem, peak: -1.0}, -math.inf, -self.mem_const[t])
        n = len(m.lb)
        cost = np.zeros(n)
        cost[peak] = 1.0
        A = coo_matrix((m.vals, (m.rows, m.cols)), shape=(len(m.row_lb), n)).tocsr()
        res = milp(cost, integrality=np.array(m.integral), bounds=(m.lb, m.ub),
                   constraints=LinearConstraint(A, m.row_lb, m.row_ub),
                   options={"time_limit": max(time_limit, 1.0), "mip_rel_gap": gap, "disp": False})
        bound = getattr(res, "mip_dual_bound", None)
        bound = None if bound is None or not np.isfinite(bound) else bound * self.scale
        if res.x is None:
            return None, False, bound, f"no solution ({res.message})"
        at: dict[str, int] = {}
        for v in self.ops:
            lo, hi = self.win[v]
            at[v] = lo if lo == hi else max(range(lo, hi + 1), key=lambda t: res.x[self.R[v, t]])
        order = sorted(self.ops, key=lambda v: at[v])
        return order, res.status == 0, bound, (f"{res.message} objective {res.fun * self.scale:.6g}"
                                               f" ({n} cols, {len(m.row_lb)} rows)")


def _kept(P: dict[int, int], span: _EdgeSpan, t: int) -> int | float | None:
    """Whether the tensor is kept at step ``t``: a column, certainly (1.0), or never (None)."""
    if t <= span.lo_s or t > span.end_hi:
        return None
    if span.hi_s < t <= span.end_lo:
        return 1.0
    return P[t]


def _solve_window(graph: DataflowGraph, ops: list[str], win: dict[str, tuple[int, int]],
                  deps: list[tuple[str, str]], edges: list[str], steps: range,
                  const_mem: dict[int, float], time_limit: float, gap: float,
                  follow: dict[str, str] | None = None
                  ) -> tuple[list[str] | None, bool, float | None, str]:
    """Solve the ILP; nodes with a one-step window are fixed. Returns (order, optimal,
    lower bound on the peak over `steps` in bytes, message). `ops` must be topological."""
    ilp = _WindowILP(graph, ops, win, steps, const_mem, edges)
    ilp.add_schedule()
    ilp.add_order(deps, follow or {})
    for e_name in edges:
        ilp.add_tensor(e_name)
    return ilp.solve(time_limit, gap)


def _ilp_size(win: dict[str, tuple[int, int]]) -> int:
    return sum(2 * (hi - lo + 1) for lo, hi in win.values())


def _split_outputs(graph: DataflowGraph, order: Sequence[str]) -> tuple[list[str], list[str]]:
    ops = [n for n in order if not graph.nodes[n].resident and graph.nodes[n].kind != OUTPUT]
    outs = [n for n in order if graph.nodes[n].kind == OUTPUT]
    return ops, outs


def ilp_order(graph: DataflowGraph, time_limit: float = 60.0, mip_rel_gap: float = 1e-4,
              order: Sequence[str] | None = None) -> ScheduleResult:
    """The whole-graph ILP. Raises GraphError if HiGHS found no order within the limit."""
    t0 = time.perf_counter()
    ops, outs = _split_outputs(graph, order or graph.program_order())
    opset = set(ops)
    deps = _deps(graph, opset)
    win = asap_alap(ops, deps)
    edges = [e.name for e in graph.memory_edges() if e.src in opset]
    res_bytes = float(graph.resident_bytes())
    found, optimal, bound, msg = _solve_window(
        graph, ops, win, deps, edges, range(len(ops)), {t: res_bytes for t in range(len(ops))},
        time_limit, mip_rel_gap, followers(graph, ops, deps))
    if found is None:
        raise GraphError(f"ILP found no order: {msg}")
    full = found + outs
    prof = simulate(graph, full)  # checks the order
    lb = None if bound is None else int(math.floor(bound + 1e-6 * max(bound, 1.0)))
    if optimal:
        lb = prof.peak if lb is None else max(lb, int(prof.peak * (1 - mip_rel_gap)))
    return ScheduleResult(full, prof.peak, optimal, "ilp", time.perf_counter() - t0, lb, [msg])


def _profile_key(memory: Sequence[int]) -> list[int]:
    return sorted(memory, reverse=True)


# Window search (large-neighbourhood search) tuning.
PEAK_POSITIONS = (0.5, 0.2, 0.8)  # where a peak step sits in a candidate window (fraction of it)
WINDOW_SHRINK = 0.7  # a sub-problem not solved to optimality shrinks the window by this factor
WINDOW_GROW = 1.25  # one solved within FAST_SOLVE of its time limit grows it by this factor
FAST_SOLVE = 0.25
MIN_WINDOW = 8
MAX_WINDOW_GROWTH = 4  # the window never grows past this many times the one asked for
SUB_LIMIT_SHARE = 1 / 8  # default seconds per sub-problem: this share of the time limit ...
SUB_LIMIT_RANGE = (2.0, 10.0)  # ... clipped to this range
MIN_SOLVE_SECONDS = 1.0  # less time than this left: stop


@dataclass(frozen=True)
class _Window:
    """The sub-problem of steps [a, b): windows, dependencies, tensors and fixed memory."""

    a: int
    b: int
    win: dict[str, tuple[int, int]]
    deps: list[tuple[str, str]]
    follow: dict[str, str]
    tensors: list[str]
    const: dict[int, float]


def _candidate_windows(mem: list[int], window: int, tried: set[tuple[int, int]]) -> list[tuple[int, int]]:
    T = len(mem)
    cands = []
    for t in (t for t in range(T) if mem[t] == max(mem)):
        for shift in PEAK_POSITIONS:
            a = max(0, min(T - window, int(t - window * shift)))
            cands.append((a, min(T, a + window)))
    return [c for c in dict.fromkeys(cands) if c not in tried]


def _window_problem(graph: DataflowGraph, cur: list[str], outs: list[str], memory: list[int],
                    deps: list[tuple[str, str]], a: int, b: int) -> _Window:
    """Steps [a, b) of ``cur`` free, every other node fixed; memory of the tensors untouched by
    the window is a constant."""
    seg = set(cur[a:b])
    opset = set(cur)
    inner = [(u, w) for u, w in deps if u in seg and w in seg]
    win = {v: (i, i) for i, v in enumerate(cur)}
    win.update(asap_alap(cur[a:b], inner, a))
    touching = {e.name for e in graph.memory_edges()
                if e.src in opset and (e.src in seg or any(s in seg for s in e.sinks))}
    life = lifetimes(graph, cur + outs)
    const = {t: float(memory[t]) for t in range(a, b)}
    for e_name in touching:
        lo, hi = life[e_name]
        for t in range(max(lo, a), min(hi, b - 1) + 1):
            const[t] -= graph.edges[e_name].size
    return _Window(a, b, win, [(u, w) for u, w in deps if u in seg or w in seg],
                   followers(graph, cur[a:b], inner), sorted(touching), const)


def lns_improve(graph: DataflowGraph, order: Sequence[str], time_limit: float = 60.0,
                window: int = 40, sub_limit: float | None = None, mip_rel_gap: float = 1e-4
                ) -> ScheduleResult:
    """Re-solve the ILP over `window` consecutive steps around the peak, others fixed.

    A new order is taken when its memory profile, sorted from high to low, is lexicographically
    smaller (so the peak never rises and the search cannot cycle). The window shrinks when a
    sub-problem is not solved in `sub_limit` seconds and grows when it is solved fast. Stops
    when time is up or no window around any peak step improves.
    """
    t0 = time.perf_counter()
    if sub_limit is None:
        sub_limit = max(SUB_LIMIT_RANGE[0], min(SUB_LIMIT_RANGE[1], time_limit * SUB_LIMIT_SHARE))
    cur, outs = _split_outputs(graph, order)
    deps = _deps(graph, set(cur))
    prof = simulate(graph, cur + outs)
    log: list[str] = []
    tried: set[tuple[int, int]] = set()
    max_window = MAX_WINDOW_GROWTH * window
    while time.perf_counter() - t0 < time_limit:
        cands = _candidate_windows(prof.memory[:len(cur)], window, tried)
        left = min(sub_limit, time_limit - (time.perf_counter() - t0))
        if not cands or left < MIN_SOLVE_SECONDS:
            break
        tried.add(cands[0])
        w = _window_problem(graph, cur, outs, prof.memory, deps, *cands[0])
        t_sub = time.perf_counter()
        found, sub_opt, _, _ = _solve_window(graph, cur, w.win, w.deps, w.tensors, range(w.a, w.b),
                                             w.const, left, mip_rel_gap, w.follow)
        if found is None or not sub_opt:  # too hard at this size: shrink the window
            window = max(MIN_WINDOW, int(window * WINDOW_SHRINK))
        elif time.perf_counter() - t_sub < sub_limit * FAST_SOLVE:
            window = min(max_window, int(window * WINDOW_GROW) + 1)
        if found is None:
            continue
        new_prof = simulate(graph, found + outs)
        if _profile_key(new_prof.memory) < _profile_key(prof.memory):
            log.append(f"window [{w.a},{w.b}): peak {prof.peak} -> {new_prof.peak}")
            cur, prof = found, new_prof
            tried.clear()
    graph.check_order(cur + outs)
    return ScheduleResult(cur + outs, prof.peak, False, "lns", time.perf_counter() - t0, None, log)


def optimal_order(graph: DataflowGraph, time_limit: float = 60.0, mip_rel_gap: float = 1e-4,
                  max_ilp_cols: int = 200_000, ilp_share: float = 0.5,
                  lns_window: int = 40) -> ScheduleResult:
    """Lowest-peak order we can find within about `time_limit` seconds.

    Starts from the better of the program order and the optimizer rewrite. When the whole ILP
    is small enough (`max_ilp_cols` decision columns) it gets `ilp_share` of the time; if it
    does not prove optimality, window search improves the best order found for the rest. `optimal` is True only when HiGHS proved the whole ILP
    optimal (within `mip_rel_gap`).
    """
    t0 = time.perf_counter()
    base = [n for n in graph.program_order() if not graph.nodes[n].resident]
    cands = {"program": base, "rewrite": optimizer_rewrite(graph, base)}
    best_name, best = min(cands.items(), key=lambda kv: simulate(graph, kv[1]).peak)
    best_res = ScheduleResult(best, simulate(graph, best).peak, False, best_name, 0.0)
    ops, _ = _split_outputs(graph, base)
    win = asap_alap(ops, _deps(graph, set(ops)))
    cols = _ilp_size(win)
    log: list[str] = []
    lower: int | None = None
    if cols <= max_ilp_cols:
        share = time_limit * ilp_share
        try:
            res = ilp_order(graph, share, mip_rel_gap, base)
            log += res.log
            lower = res.lower_bound
            if res.optimal or res.peak <= best_res.peak:
                best_res = res
        except GraphError as err:
            log.append(str(err))
    else:
        log.append(f"whole ILP too large ({cols} columns): window search only")
    left = time_limit - (time.perf_counter() - t0)
    if not best_res.optimal and left >= 1.0:
        res = lns_improve(graph, best_res.order, left, window=lns_window,
                          mip_rel_gap=mip_rel_gap)
        log += res.log
        if res.peak < best_res.peak:
            best_res = res
    best_res.lower_bound = lower if best_res.lower_bound is None else best_res.lower_bound
    graph.check_order(best_res.order)
    best_res.peak = simulate(graph, best_res.order).peak
    best_res.solve_time = time.perf_counter() - t0
    best_res.log = log + [m for m in best_res.log if m not in log]
    return best_res
