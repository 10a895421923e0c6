"""Simulator on hand-made graphs whose peaks are worked out by hand."""
import pytest

from analysis.memory.dataflow import WEIGHT, DataflowGraph, GraphError
from analysis.memory.simulate import simulate


def chain() -> DataflowGraph:
    # a -> b -> c, sizes 10, 20, 5; c's output is returned
    g = DataflowGraph()
    for n in "abc":
        g.add_node(n)
    g.add_edge("x", "a", ["b"], size=10)
    g.add_edge("y", "b", ["c"], size=20)
    g.add_edge("z", "c", [], size=5, is_output=True)
    return g


def test_chain_peak_is_largest_adjacent_pair():
    p = simulate(chain())
    assert p.memory == [10, 30, 25]
    assert p.peak == 30 and p.peak_node == "b"


def test_resident_weight_counts_everywhere_and_dead_output_only_at_its_step():
    g = chain()
    g.add_node("w", kind=WEIGHT)
    g.add_edge("wt", "w", ["b"], size=100)
    g.add_node("d")
    g.add_edge("dead", "d", [], size=7)          # nobody reads it
    g.add_edge("dx", "a", ["d"], size=0)         # d after a
    p = simulate(g, ["a", "d", "b", "c"])
    assert p.resident == 100
    assert p.memory == [110, 117, 130, 125]


def test_order_changes_peak_on_diamond():
    # s fans out to a big producer and a small one; running the big branch's consumer early
    g = DataflowGraph()
    for n in ["s", "big", "small", "join"]:
        g.add_node(n)
    g.add_edge("e_s", "s", ["big", "small"], size=1)
    g.add_edge("e_big", "big", ["join"], size=50)
    g.add_edge("e_small", "small", ["join"], size=3)
    assert simulate(g, ["s", "big", "small", "join"]).memory == [1, 51, 54, 53]
    assert simulate(g, ["s", "small", "big", "join"]).memory == [1, 4, 54, 53]


def test_view_edge_extends_base_lifetime_without_double_counting():
    # a allocates 8 bytes, v is a view (size 0) read by c: base lives until c
    g = DataflowGraph()
    for n in ["a", "v", "b", "c"]:
        g.add_node(n)
    g.add_edge("base", "a", ["v", "c"], size=8)
    g.add_edge("view", "v", ["c"], size=0)
    g.add_edge("tmp", "b", ["c"], size=2)
    g.add_edge("ab", "a", ["b"], size=0)
    assert simulate(g, ["a", "v", "b", "c"]).memory == [8, 8, 10, 10]


def test_bad_orders_are_rejected():
    g = chain()
    with pytest.raises(GraphError, match="not topological"):
        simulate(g, ["b", "a", "c"])
    with pytest.raises(GraphError, match="misses"):
        simulate(g, ["a", "b"])
    with pytest.raises(GraphError, match="twice"):
        simulate(g, ["a", "b", "b", "c"])
    with pytest.raises(GraphError, match="unknown"):
        simulate(g, ["a", "b", "q", "c"])


def test_lazy_exports_resolve():
    import analysis

    for name in ["DataflowGraph", "peak_memory", "optimal_order", "import_training_step"]:
        assert callable(getattr(analysis, name))
    assert analysis.peak_memory(chain()) == 30
