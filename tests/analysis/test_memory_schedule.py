"""Scheduler: exact on small graphs (vs brute force), and beats a bad given order."""
import random

import networkx as nx
import pytest

from analysis.memory.dataflow import BACKWARD, FORWARD, OPTIMIZER, WEIGHT, DataflowGraph
from analysis.memory.schedule import ilp_order, lns_improve, optimal_order, optimizer_rewrite
from analysis.memory.simulate import simulate


def brute_force(g: DataflowGraph) -> int:
    return min(simulate(g, o, check=False).peak for o in nx.all_topological_sorts(g.to_networkx()))


def random_graph(n: int, seed: int, zero_edges: bool = False) -> DataflowGraph:
    rng = random.Random(seed)
    g = DataflowGraph()
    for i in range(n):
        g.add_node(f"n{i}")
    for i in range(n - 1):
        for j in range(rng.randint(0, 2)):
            sinks = rng.sample(range(i + 1, n), min(n - i - 1, rng.randint(1, 3)))
            size = 0 if zero_edges and rng.random() < 0.4 else rng.randint(1, 10)
            g.add_edge(f"e{i}_{j}", f"n{i}", [f"n{s}" for s in sorted(sinks)], size=size)
    g.add_edge("out", f"n{n - 1}", [], size=rng.randint(1, 10), is_output=True)
    return g


@pytest.mark.parametrize("seed", range(24))
def test_ilp_equals_brute_force(seed):
    g = random_graph(4 + seed % 5, seed, zero_edges=seed % 2 == 1)
    res = ilp_order(g, time_limit=20)
    g.check_order(res.order)
    assert res.optimal
    assert res.peak == simulate(g, res.order).peak == brute_force(g)


def crafted() -> DataflowGraph:
    """Two independent 'branches': each makes a big tensor and reduces it to a small one.
    Program order makes both big tensors before reducing either (peak 100 + 100 + 1); the
    optimal order finishes one branch first (peak 100 + 1 + 1, while reducing the second)."""
    g = DataflowGraph()
    for n in ["bigA", "bigB", "redA", "redB", "join"]:
        g.add_node(n)
    g.add_edge("A", "bigA", ["redA"], size=100)
    g.add_edge("B", "bigB", ["redB"], size=100)
    g.add_edge("a", "redA", ["join"], size=1)
    g.add_edge("b", "redB", ["join"], size=1)
    g.add_edge("out", "join", [], size=1, is_output=True)
    return g


def test_strictly_better_than_bad_program_order():
    g = crafted()
    bad = simulate(g).peak
    res = optimal_order(g, time_limit=20)
    assert bad == 201
    assert res.optimal and res.peak == 102 == brute_force(g) < bad
    g.check_order(res.order)


def training_like() -> DataflowGraph:
    """fwd1 -> fwd2 -> loss -> bwd2 -> bwd1, each bwd makes a weight gradient that an optimizer
    node consumes; PyTorch runs all optimizer nodes at the end, so gradients pile up."""
    g = DataflowGraph()
    for w in ("w1", "w2"):
        g.add_node(w, kind=WEIGHT)
    for n, k in [("f1", FORWARD), ("f2", FORWARD), ("loss", FORWARD), ("b2", BACKWARD),
                 ("b1", BACKWARD), ("o2", OPTIMIZER), ("o1", OPTIMIZER)]:
        g.add_node(n, kind=k)
    g.add_edge("w1t", "w1", ["f1", "b1", "o1"], size=40)
    g.add_edge("w2t", "w2", ["f2", "b2", "o2"], size=40)
    g.add_edge("h1", "f1", ["f2", "b1"], size=10)
    g.add_edge("h2", "f2", ["loss", "b2"], size=10)
    g.add_edge("l", "loss", ["b2"], size=1)
    g.add_edge("dh", "b2", ["b1"], size=10)
    g.add_edge("g2", "b2", ["o2"], size=40)
    g.add_edge("g1", "b1", ["o1"], size=40)
    g.add_edge("u2", "o2", [], size=40)   # optimizer temporaries, freed at once
    g.add_edge("u1", "o1", [], size=40)
    return g


def test_optimizer_rewrite_moves_updates_after_their_gradient():
    g = training_like()
    order = optimizer_rewrite(g)
    assert order == ["f1", "f2", "loss", "b2", "o2", "b1", "o1"]
    assert simulate(g, order).peak < simulate(g).peak
    res = optimal_order(g, time_limit=20)
    assert res.optimal and res.peak == brute_force(g) <= simulate(g, order).peak


def test_window_search_never_worsens_and_returns_valid_order():
    g = random_graph(40, 3)
    start = simulate(g).peak
    res = lns_improve(g, g.program_order(), time_limit=8, window=12)
    g.check_order(res.order)
    assert res.peak == simulate(g, res.order).peak <= start
