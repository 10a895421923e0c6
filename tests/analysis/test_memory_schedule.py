"""Scheduler: exact on small graphs (vs brute force), beats a bad given order, never loses to
the greedy heuristic, and its reduced problem and lower bound are sound."""
import random

import networkx as nx
import pytest
import torch

from analysis.memory.dataflow import BACKWARD, FORWARD, OPTIMIZER, WEIGHT, DataflowGraph
from analysis.memory.ilp import column_count, twins
from analysis.memory.problem import reduce_graph
from analysis.memory.schedule import (band_windows, greedy_order, ilp_order, lns_improve,
                                      optimal_order, optimizer_rewrite)
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


def random_order(g: DataflowGraph, seed: int) -> list[str]:
    """A random topological order of the op nodes."""
    rng = random.Random(seed)
    nxg = g.to_networkx()
    waiting = {n: nxg.in_degree(n) for n in nxg}
    ready, out = [n for n, d in waiting.items() if d == 0], []
    while ready:
        n = ready.pop(rng.randrange(len(ready)))
        out.append(n)
        for s in nxg.successors(n):
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_reduced_problem_keeps_peaks_and_never_raises_one(seed):
    """Nodes that allocate nothing run as soon as they can: the reduced problem's peak is the
    simulated peak of the expanded order, and never above the order it came from."""
    g = random_graph(30, seed, zero_edges=True)
    prob = reduce_graph(g)
    assert prob.zero and len(prob) < len(g.op_nodes())
    for order in (g.program_order(), greedy_order(g), random_order(g, seed)):
        proj = prob.project(order)
        full = prob.expand(proj)
        g.check_order(full)
        assert simulate(g, full).peak == prob.peak(proj) <= simulate(g, order).peak


@pytest.mark.parametrize("seed", range(12))
def test_lower_bound_is_a_bound(seed):
    g = random_graph(5 + seed % 4, 100 + seed, zero_edges=seed % 2 == 0)
    assert reduce_graph(g).lower_bound() <= brute_force(g)


def test_greedy_runs_the_node_that_frees_most():
    g = crafted()
    order = greedy_order(g)
    assert order == ["bigA", "redA", "bigB", "redB", "join"]
    assert simulate(g, order).peak == 102 < simulate(g).peak


def twin_branches() -> DataflowGraph:
    """s feeds two identical nodes a and b (same input, same output size and reader)."""
    g = DataflowGraph()
    for n in ["s", "a", "b", "big", "join"]:
        g.add_node(n)
    g.add_edge("x", "s", ["a", "b", "big"], size=4)
    g.add_edge("ya", "a", ["join"], size=5)
    g.add_edge("yb", "b", ["join"], size=5)
    g.add_edge("z", "big", ["join"], size=9)
    g.add_edge("out", "join", [], size=1, is_output=True)
    return g


def test_twins_are_ordered_and_the_ilp_stays_exact():
    g = twin_branches()
    prob = reduce_graph(g)
    _, desc = prob.reach()
    assert twins(prob, desc) == [(prob.index["a"], prob.index["b"])]
    res = ilp_order(g, time_limit=5)
    assert res.optimal and res.peak == brute_force(g)
    assert res.order.index("a") < res.order.index("b")


def test_band_windows_fit_the_cap_and_hold_the_start():
    prob = reduce_graph(random_graph(60, 5))
    win = prob.windows()
    start = list(range(len(prob)))  # node indices follow the program order
    cut, band = band_windows(win, start, column_count(win) // 3)
    assert band is not None and column_count(cut) <= column_count(win) // 3
    assert all(lo <= t <= hi for t, (lo, hi) in zip(start, cut))
    assert band_windows(win, start, column_count(win)) == (win, None)


def test_ilp_keeps_its_warm_start_when_out_of_time():
    pytest.importorskip("highspy")  # scipy's HiGHS takes no warm start
    g = random_graph(80, 11)
    start = greedy_order(g)
    res = ilp_order(g, time_limit=0.1, start=start)
    g.check_order(res.order)
    assert res.peak <= simulate(g, start).peak


def imported_mlp() -> DataflowGraph:
    from analysis.memory.importer import import_training_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return import_training_step(model, [torch.randn(8, 64)])[0]


def imported_gpt2_block() -> DataflowGraph:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from analysis.memory.importer import import_training_step

    torch.manual_seed(0)
    block = GPT2Block(GPT2Config(n_embd=64, n_head=4, n_positions=64)).train()
    return import_training_step(block, [torch.randn(4, 32, 64)])[0]


GRAPHS = {
    "crafted": crafted, "training_like": training_like, "twins": twin_branches,
    "random40": lambda: random_graph(40, 3), "random60": lambda: random_graph(60, 7, True),
    "mlp_adam": imported_mlp, "gpt2_block": imported_gpt2_block,
}


@pytest.mark.parametrize("name", list(GRAPHS))
def test_scheduler_never_worse_than_greedy_rewrite_or_program(name):
    g = GRAPHS[name]()
    res = optimal_order(g, time_limit=3)
    g.check_order(res.order)
    starts = {"program": g.program_order(), "rewrite": optimizer_rewrite(g),
              "greedy": greedy_order(g)}
    assert res.baselines == {k: simulate(g, o).peak for k, o in starts.items()}
    assert res.peak == simulate(g, res.order).peak <= min(res.baselines.values())
    assert res.lower_bound is not None and res.lower_bound <= res.peak
    assert 0.0 <= res.gap < 1.0


def test_scheduler_beats_program_order_on_a_training_graph():
    """Adam on the benchmark's MLP: gradients no longer pile up until the optimizer runs."""
    from analysis.memory.importer import import_training_step
    from analysis.models import build

    g, _ = import_training_step(*build("mlp", 8))
    res = optimal_order(g, time_limit=3)
    assert res.peak <= 0.95 * res.baselines["program"]
    assert res.optimal  # the peak reached the lower bound
