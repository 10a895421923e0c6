"""The peak-memory ordering ILP over a `ScheduleProblem`, solved by HiGHS from a warm start.

One node per step, steps 0..T-1, after Steiner et al., "OLLA: Optimizing the Lifetime and
Location of Arrays" (2022), in the cumulative form (fewer columns than run-at plus kept-at, and a
tighter relaxation of the precedences):
  D[v,t] in {0,1}, only for lo(v) <= t < hi(v): v has run by step t (0 before its window, 1 from
            hi(v) on; a node with a one-step window has no column);
  P[e,t] in [0,1], only where tensor e's liveness is not a single difference of two D's;
  peak      the objective.
Rows: D[v,t] <= D[v,t+1]; sum_v D[v,t] = t+1 (one node per step); D[w,t] <= D[u,t-1] for each
dependency u -> w of the transitive reduction; memory(t) = constant(t) + sum size * live <= peak.
Tensor e made by s is live at t iff D[s,t] and some x in its sinks or s itself has not run by
t-1: with one undecided x that can only run after s, live = D[s,t] - D[x,t-1] exactly; else
P >= D[s,t] - D[x,t-1] for the undecided x's that no other undecided one descends from.
Windows are ASAP/ALAP (optionally cut to a band around the warm start: then no proof), and
interchangeable nodes (same predecessors, successors, inputs, output sizes and readers) run in
index order (symmetry breaking). HiGHS gets the warm start through ``setSolution``; without
highspy installed, scipy's HiGHS runs without it.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix

from analysis.memory.problem import ScheduleProblem

Expr = tuple[dict[int, float], float]  # (column -> coefficient, constant)


@dataclass
class ILPSolution:
    """`order` (problem node indices) or None; `optimal`: HiGHS proved it within the gap;
    `bound`: HiGHS's dual bound on the peak in bytes (None if it has none)."""

    order: list[int] | None
    optimal: bool
    bound: float | None
    message: str
    columns: int
    rows: int


def column_count(win: Sequence[tuple[int, int]]) -> int:
    """D columns of windows `win` (the bulk of the model)."""
    return sum(hi - lo for lo, hi in win)


def reduced_deps(prob: ScheduleProblem, anc: list[int]) -> list[tuple[int, int]]:
    """Dependencies not implied by others (u -> w dropped when u is an ancestor of another
    predecessor of w)."""
    out = []
    for w, ps in enumerate(prob.preds):
        union = 0
        for p in ps:
            union |= anc[p]
        out += [(p, w) for p in ps if not (union >> p) & 1]
    return out


def twins(prob: ScheduleProblem, desc: list[int]) -> list[tuple[int, int]]:
    """Pairs (a, b), a < b, of interchangeable nodes: swapping them changes no step's memory,
    so some optimal order runs a first."""
    reads: list[list[str]] = [[] for _ in prob.nodes]
    makes: list[list[tuple]] = [[] for _ in prob.nodes]
    for e in prob.tensors:
        makes[e.src].append((e.size, e.sinks, e.to_end))
        for s in e.sinks:
            reads[s].append(e.name)
    succs: list[list[int]] = [[] for _ in prob.nodes]
    for w, ps in enumerate(prob.preds):
        for p in ps:
            succs[p].append(w)
    groups: dict[tuple, list[int]] = {}
    for v in range(len(prob.nodes)):
        key = (tuple(prob.preds[v]), tuple(sorted(succs[v])), tuple(sorted(reads[v])), tuple(sorted(makes[v])))
        groups.setdefault(key, []).append(v)
    return [(a, b) for g in groups.values() for a, b in zip(g, g[1:]) if not (desc[a] >> b) & 1]


class OrderILP:
    """The model over `prob` with windows `win` (every node; lo == hi fixes a node), memory rows
    for `steps`, `const[t]` bytes live at t that the model does not see, and the tensors
    (indices into prob.tensors) it does see."""

    def __init__(
        self,
        prob: ScheduleProblem,
        win: Sequence[tuple[int, int]],
        steps: range,
        const: Sequence[float],
        tensors: Sequence[int],
        desc: list[int],
    ) -> None:
        self.prob, self.win, self.steps, self.desc = prob, list(win), steps, desc
        self.scale = float(max([prob.tensors[i].size for i in tensors] + [1]))
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integral: list[int] = []
        self.r_rows: list[int] = []
        self.r_cols: list[int] = []
        self.r_vals: list[float] = []
        self.row_lb: list[float] = []
        self.row_ub: list[float] = []
        self.D: dict[tuple[int, int], int] = {}
        self.p_defs: list[tuple[int, Expr, list[Expr]]] = []  # P column, D[s,t], the D[x,t-1]
        self.mem: dict[int, dict[int, float]] = {t: {} for t in steps}
        self.mem_const = np.asarray([const[t - steps.start] for t in steps], float) / self.scale
        self.tensors = list(tensors)

    # ---- columns and rows -------------------------------------------------------------------
    def col(self, integral: bool, lb: float = 0.0, ub: float = 1.0) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integral.append(int(integral))
        return len(self.lb) - 1

    def row(self, terms: dict[int, float], lo: float, hi: float) -> None:
        r = len(self.row_lb)
        for c, v in terms.items():
            if v:
                self.r_rows.append(r)
                self.r_cols.append(c)
                self.r_vals.append(v)
        self.row_lb.append(lo)
        self.row_ub.append(hi)

    def d(self, v: int, t: int) -> int | float:
        """D[v,t]: a column, or 0.0 / 1.0 outside v's window."""
        lo, hi = self.win[v]
        return 0.0 if t < lo else 1.0 if t >= hi else self.D[v, t]

    def build(self, deps: Sequence[tuple[int, int]], pairs: Sequence[tuple[int, int]]) -> None:
        self._add_schedule()
        for u, w in deps:
            self._add_dep(u, w)
        for a, b in pairs:  # a runs first: D[b,t] <= D[a,t]
            self._add_dep(a, b, lag=0)
        for i in self.tensors:
            self._add_tensor(i)

    def _add_schedule(self) -> None:
        """D columns, D monotone, and exactly t + 1 nodes run by step t."""
        for v, (lo, hi) in enumerate(self.win):
            if lo > hi:
                raise ValueError(f"empty window for {self.prob.nodes[v]!r}: [{lo}, {hi}]")
            for t in range(lo, hi):
                self.D[v, t] = self.col(True)
            for t in range(lo, hi - 1):
                self.row({self.D[v, t]: 1.0, self.D[v, t + 1]: -1.0}, -math.inf, 0.0)
        his = sorted(hi for _, hi in self.win)
        by_step: dict[int, dict[int, float]] = {}
        for (_v, t), c in self.D.items():
            by_step.setdefault(t, {})[c] = 1.0
        for t, terms in sorted(by_step.items()):
            done = bisect_right(his, t)  # nodes whose window ended by t
            self.row(terms, t + 1 - done, t + 1 - done)

    def _add_dep(self, u: int, w: int, lag: int = 1) -> None:
        """D[w,t] <= D[u,t-lag]: w runs after u (lag 1) or no earlier than u (lag 0)."""
        lo, hi = self.win[w]
        for t in range(lo, hi):
            x = self.d(u, t - lag)
            if isinstance(x, float):
                if x == 0.0:  # u cannot have run: w cannot either
                    self.ub[self.D[w, t]] = 0.0
            else:
                self.row({self.D[w, t]: 1.0, x: -1.0}, -math.inf, 0.0)

    # ---- tensors --------------------------------------------------------------------------
    def _add_tensor(self, i: int) -> None:
        """Bytes of tensor i at every modelled step of its possible life."""
        e = self.prob.tensors[i]
        size = e.size / self.scale
        lo_s, hi_s = self.win[e.src]
        xs = [e.src, *e.sinks]
        last = self.steps.stop - 1 if e.to_end else max(self.win[x][1] for x in xs)
        sure_to = last if e.to_end else max(self.win[x][0] for x in xs)  # live on [hi_s, sure_to]
        for t in range(max(lo_s, self.steps.start), min(last, self.steps.stop - 1) + 1):
            if hi_s <= t <= sure_to:
                self.mem_const[t - self.steps.start] += size
                continue
            terms, const = self._live(e.src, xs, t, e.to_end)
            self.mem_const[t - self.steps.start] += size * const
            mem = self.mem[t]
            for c, v in terms.items():
                mem[c] = mem.get(c, 0.0) + size * v

    def _live(self, src: int, xs: list[int], t: int, to_end: bool) -> Expr:
        """Liveness at t of a tensor made by `src` and waited on by `xs` (src included)."""
        s = self.d(src, t)
        if isinstance(s, float) and s == 0.0:
            return {}, 0.0
        made: Expr = ({}, 1.0) if isinstance(s, float) else ({s: 1.0}, 0.0)
        done = [(x, self.d(x, t - 1)) for x in xs]
        if to_end or any(isinstance(v, float) and v == 0.0 for _, v in done):
            return made
        undecided = [x for x, v in done if not isinstance(v, float)]
        undecided = [x for x in undecided if not any(y != x and (self.desc[x] >> y) & 1 for y in undecided)]
        if not undecided:
            return {}, 0.0
        x = undecided[0]
        if len(undecided) == 1 and (x == src or (self.desc[src] >> x) & 1):
            terms = dict(made[0])
            terms[self.D[x, t - 1]] = terms.get(self.D[x, t - 1], 0.0) - 1.0
            return terms, made[1]
        p = self.col(False)
        dx = [({self.D[y, t - 1]: 1.0}, 0.0) for y in undecided]
        for terms_x, _ in dx:  # P >= D[s,t] - D[x,t-1]
            terms = {p: 1.0, **{c: -v for c, v in made[0].items()}}
            for c, v in terms_x.items():
                terms[c] = terms.get(c, 0.0) + v
            self.row(terms, made[1], math.inf)
        self.p_defs.append((p, made, dx))
        return {p: 1.0}, 0.0

    # ---- solving ----------------------------------------------------------------------------
    def solve(
        self,
        time_limit: float,
        gap: float,
        start: Sequence[int] | None = None,
        peak_lb: float = 0.0,
        peak_ub: float = math.inf,
    ) -> ILPSolution:
        """Minimise the peak; `start` (an order that fits the windows) is the warm start,
        `peak_lb`/`peak_ub` (bytes) bound the peak column."""
        peak = self.col(False, peak_lb / self.scale, peak_ub / self.scale)
        mem_rows = []
        for t in self.steps:
            mem_rows.append(len(self.row_lb))
            self.row({**self.mem[t], peak: -1.0}, -math.inf, -self.mem_const[t - self.steps.start])
        n = len(self.lb)
        A = coo_matrix((self.r_vals, (self.r_rows, self.r_cols)), shape=(len(self.row_lb), n)).tocsr()
        cost = np.zeros(n)
        cost[peak] = 1.0
        x0 = None if start is None else self._start(start, peak, A, mem_rows)
        x, optimal, bound, msg = solve_mip(
            cost,
            np.asarray(self.lb),
            np.asarray(self.ub),
            np.asarray(self.integral, dtype=np.int32),
            A,
            np.asarray(self.row_lb),
            np.asarray(self.row_ub),
            x0,
            time_limit,
            gap,
        )
        order = None if x is None else self._order(x)
        return ILPSolution(
            order,
            optimal and order is not None,
            None if bound is None else bound * self.scale,
            f"{msg} ({n} columns, {len(self.row_lb)} rows)",
            n,
            len(self.row_lb),
        )

    def _start(self, start: Sequence[int], peak: int, A, mem_rows: list[int]) -> np.ndarray:
        """The column values of order `start`."""
        pos = {v: t for t, v in enumerate(start)}
        x = np.zeros(len(self.lb))
        for (v, t), c in self.D.items():
            x[c] = 1.0 if pos[v] <= t else 0.0
        for p, (made_terms, made_const), dx in self.p_defs:
            made = made_const + sum(x[c] * v for c, v in made_terms.items())
            x[p] = max([0.0] + [made - sum(x[c] * v for c, v in terms.items()) for terms, _ in dx])
        used = A[mem_rows] @ x
        lows = -np.asarray(self.row_ub)[mem_rows]
        x[peak] = max(self.lb[peak], float((used + lows).max(initial=0.0)))
        return x

    def _order(self, x: np.ndarray) -> list[int] | None:
        """Node indices by the step the solution runs them at (None if not a permutation)."""
        at = []
        for v, (lo, hi) in enumerate(self.win):
            at.append((lo + sum(x[self.D[v, t]] < 0.5 for t in range(lo, hi)), v))
        at.sort()
        if [t for t, _ in at] != list(range(len(at))):
            return None
        return [v for _, v in at]


def solve_mip(
    cost: np.ndarray,
    lb: np.ndarray,
    ub: np.ndarray,
    integral: np.ndarray,
    A,
    row_lb: np.ndarray,
    row_ub: np.ndarray,
    x0: np.ndarray | None,
    time_limit: float,
    gap: float,
) -> tuple[np.ndarray | None, bool, float | None, str]:
    """Minimise cost @ x: (solution or None, proved optimal within `gap`, dual bound, status)."""
    try:
        import highspy
    except ImportError:
        return _solve_scipy(cost, lb, ub, integral, A, row_lb, row_ub, time_limit, gap)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    inf = highspy.kHighsInf
    clip = lambda a: np.clip(a, -inf, inf)  # noqa: E731
    h.passModel(
        len(cost),
        A.shape[0],
        A.nnz,
        2,
        1,
        0.0,
        cost,
        clip(lb),
        clip(ub),
        clip(row_lb),
        clip(row_ub),
        A.indptr.astype(np.int32),
        A.indices.astype(np.int32),
        A.data.astype(np.float64),
        integral,
    )
    h.setOptionValue("time_limit", max(float(time_limit), 0.1))
    h.setOptionValue("mip_rel_gap", float(gap))
    if x0 is not None:
        sol = highspy.HighsSolution()
        sol.col_value = x0.tolist()
        h.setSolution(sol)
    h.run()
    status, info = h.getModelStatus(), h.getInfo()
    has = info.primal_solution_status == int(highspy.SolutionStatus.kSolutionStatusFeasible)
    x = np.asarray(h.getSolution().col_value) if has else None
    bound = info.mip_dual_bound if np.isfinite(info.mip_dual_bound) else None
    return (
        x,
        status == highspy.HighsModelStatus.kOptimal,
        bound,
        f"HiGHS {h.modelStatusToString(status)}, gap {info.mip_gap:.3g}",
    )


def _solve_scipy(cost, lb, ub, integral, A, row_lb, row_ub, time_limit, gap):
    """HiGHS through scipy (no warm start) when highspy is not installed."""
    from scipy.optimize import LinearConstraint, milp

    res = milp(
        cost,
        integrality=integral,
        bounds=(lb, ub),
        constraints=LinearConstraint(A, row_lb, row_ub),
        options={"time_limit": max(time_limit, 1.0), "mip_rel_gap": gap, "disp": False},
    )
    bound = getattr(res, "mip_dual_bound", None)
    bound = None if bound is None or not np.isfinite(bound) else float(bound)
    return res.x, res.status == 0, bound, f"scipy HiGHS: {res.message}"
