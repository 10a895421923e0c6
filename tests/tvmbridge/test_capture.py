"""Memory-informed capture set (min-cut) and the coloured picture of the split."""
from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch

from tvmbridge import add_tvm_dispatch
from tvmbridge import compile_training
from tvmbridge.tools.visualize import COLOURS, split_categories, visualize, visualize_split

from ..helpers import MLP, bert_inputs, bert_layer, clone_module, is_tvm, max_errors, run_step


@pytest.mark.parametrize("capture", ["all", "min-cut"])
def test_mlp_grads_exact_with_each_policy(capture):
    torch.manual_seed(0)
    m = MLP()
    ref = clone_module(m)
    x = torch.randn(4, 32)
    add_tvm_dispatch(m, (x,), capture=capture)
    got, want = run_step(m, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0])
    assert max(max_errors(got, want).values()) <= 1e-5


def test_bert_all_policy_grads_exact():
    torch.manual_seed(0)
    layer = bert_layer(small=True)
    ref = clone_module(layer)
    inputs = bert_inputs(torch.float32, seq=6, hidden=64)
    add_tvm_dispatch(layer, inputs, capture="all")
    assert layer._tvm_dispatch.compiled.split.recomputed == []
    errs = max_errors(run_step(layer, inputs), run_step(ref, inputs))
    assert max(errs.values()) <= 1e-5, errs


@pytest.mark.parametrize("batch,seq", [(1, 14), (8, 128)])
def test_min_cut_keeps_fewer_bytes_than_pytorch_and_save_all(batch, seq):
    torch.manual_seed(0)
    layer = bert_layer()
    add_tvm_dispatch(layer, bert_inputs(torch.float32, batch=batch, seq=seq))
    report = layer._tvm_dispatch.report()
    assert report.policy == "min-cut"
    assert report.tvm_bytes <= report.pytorch_saved_bytes, str(report)  # masks included on our side
    assert report.captured_bytes < report.save_all_bytes, str(report)
    assert report.recomputed > 0 and report.recompute_flops > 0
    # every captured value is listed with its shape, and sizes add up
    assert sum(n for *_, n in report.captured) == report.captured_bytes


def test_smaller_memory_budget_keeps_fewer_bytes_with_exact_grads():
    torch.manual_seed(0)
    layer = bert_layer(small=True)
    inputs = bert_inputs(torch.float32, seq=6, hidden=64)
    free = compile_training(layer, inputs)
    tight = compile_training(layer, inputs, memory_budget=0.25)
    assert tight.captured_bytes() < free.captured_bytes()
    assert tight.captured_bytes() <= 0.25 * free.save_all_bytes()
    assert len(tight.split.recomputed) > len(free.split.recomputed)
    ref = clone_module(layer)
    add_tvm_dispatch(layer, inputs, memory_budget=0.25)
    assert layer._tvm_dispatch.compiled.captured_bytes() == tight.captured_bytes()
    errs = max_errors(run_step(layer, inputs), run_step(ref, inputs))
    assert max(errs.values()) <= 1e-5, errs


def test_bad_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="fraction"):
        compile_training(MLP(), (torch.randn(4, 32),), memory_budget=1.5)
    with pytest.raises(ValueError, match="min-cut"):
        compile_training(MLP(), (torch.randn(4, 32),), capture="all", memory_budget=0.5)


def _svg_nodes(svg: str) -> dict[str, str]:
    """title -> fill colour of each node in a graphviz SVG."""
    root = ET.fromstring(svg)
    ns = {"s": "http://www.w3.org/2000/svg"}
    out = {}
    for g in root.iter("{http://www.w3.org/2000/svg}g"):
        if g.get("class") != "node":
            continue
        title = g.find("s:title", ns).text
        shape = next(
            e for e in g.iter() if e.tag in ("{http://www.w3.org/2000/svg}polygon", "{http://www.w3.org/2000/svg}ellipse")
        )
        out[title] = shape.get("fill")
    return out


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz dot not installed")
def test_split_picture_renders_with_the_split_colours():
    compiled = compile_training(MLP(), (torch.randn(4, 32),))
    fn = compiled.adjoint
    svg = visualize_split(compiled).pipe(format="svg").decode()
    nodes = _svg_nodes(svg)
    assert "legend" in nodes and all(text in svg for text in ("kept for the backward", "recomputed in the backward"))
    del nodes["legend"]
    assert len(nodes) == len(fn.params) + len(fn.body.blocks[0].bindings)
    cats = split_categories(compiled)
    assert set(nodes) == set(cats)
    for key, cat in cats.items():
        assert nodes[key].lower() == COLOURS[cat].lower(), (key, cat, nodes[key])
    for cat in ("forward", "captured", "recomputed", "backward", "input"):
        assert cat in cats.values()
    # edges carry bytes
    assert re.search(r">\d+(\.\d+)? (B|KiB)<", svg)


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz dot not installed")
def test_function_picture_inlines_small_constants():
    compiled = compile_training(bert_layer(small=True), bert_inputs(torch.float32, seq=6, hidden=64))
    fn = compiled.stages["split"]["forward"]
    g = visualize(fn)
    svg = g.pipe(format="svg").decode()
    assert len(_svg_nodes(svg)) == len(fn.params) + len(fn.body.blocks[0].bindings)
    assert "0.25" in svg  # the attention scale 1/sqrt(16) written into its multiply
