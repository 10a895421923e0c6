"""Import of a small MLP training step: structure, and simulated vs measured peak."""
import copy

import pytest
import torch

from analysis.memory.dataflow import (BACKWARD, FORWARD, GRADIENT, OPT_STATE, OPTIMIZER, OUTPUT,
                               WEIGHT)
from analysis.memory.importer import import_eval_step, import_training_step
from analysis.memory.schedule import optimal_order, optimizer_rewrite
from analysis.memory.simulate import measure_fx_peak, simulate


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 10))


@pytest.fixture(scope="module")
def adam_step():
    return import_training_step(mlp(), [torch.randn(32, 64)], optimizer="adam")


def kinds(g, kind):
    return [n for n in g.nodes.values() if n.kind == kind]


def test_mlp_graph_has_parameter_gradient_and_optimizer_nodes(adam_step):
    g, traced = adam_step
    n_params = 6
    assert len(kinds(g, WEIGHT)) == n_params
    assert len(kinds(g, OPT_STATE)) == 2 * n_params          # Adam: exp_avg, exp_avg_sq
    assert kinds(g, FORWARD) and kinds(g, BACKWARD) and kinds(g, OPTIMIZER)
    assert len(kinds(g, OUTPUT)) == 1
    # each weight is written in place by an optimizer node (addcdiv_)
    for w in kinds(g, WEIGHT):
        readers = {s for e in w.outputs for s in g.edges[e].sinks}
        assert any(g.nodes[s].kind == OPTIMIZER and "addcdiv_" in g.nodes[s].op
                   for s in readers), w.name
    # one parameter gradient per weight: gradient edges that optimizer nodes read
    grads = {e.name for e in g.edges.values()
             if e.kind == GRADIENT and any(g.nodes[s].kind == OPTIMIZER for s in e.sinks)}
    assert len(grads) == n_params
    # bytes of the weights = bytes of the parameters
    assert sum(g.edges[w.outputs[0]].size for w in kinds(g, WEIGHT)) == \
        sum(p.numel() * 4 for p in mlp().parameters())


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_simulated_peak_matches_measured(optimizer):
    g, traced = import_training_step(mlp(), [torch.randn(32, 64)], optimizer=optimizer)
    measured, per_node, _ = measure_fx_peak(traced.gm, *copy.deepcopy(traced.args))
    sim = simulate(g).peak
    assert abs(sim - measured) <= 0.02 * measured
    rewritten = optimizer_rewrite(g)
    measured_rw, _, _ = measure_fx_peak(traced.gm, *copy.deepcopy(traced.args), order=rewritten)
    assert abs(simulate(g, rewritten).peak - measured_rw) <= 0.02 * measured_rw


def test_scheduled_order_keeps_results_and_its_simulated_peak(adam_step):
    g, traced = adam_step
    res = optimal_order(g, time_limit=15)
    g.check_order(res.order)
    assert res.peak <= simulate(g).peak
    args_a, args_b = copy.deepcopy(traced.args), copy.deepcopy(traced.args)
    _, _, loss_a = measure_fx_peak(traced.gm, *args_a)
    measured, _, loss_b = measure_fx_peak(traced.gm, *args_b, order=res.order)
    assert abs(measured - res.peak) <= 0.02 * measured
    torch.testing.assert_close(loss_a, loss_b)
    for pa, pb in zip(args_a[0] + args_a[1], args_b[0] + args_b[1]):  # updated params, state
        torch.testing.assert_close(pa, pb)


def test_eval_step_import_matches_measured():
    model = mlp().eval()
    g, traced = import_eval_step(model, [torch.randn(8, 64)])
    assert not kinds(g, BACKWARD) and not kinds(g, OPTIMIZER)
    measured, _, _ = measure_fx_peak(traced.gm, *traced.args)
    assert abs(simulate(g).peak - measured) <= 0.02 * measured


def test_keyword_inputs_with_none_and_flags():
    """Inputs by name, as the model zoo builds them: tensors become graph inputs, ``None`` and
    flags stay constants (no wrapper module needed for ``attention_mask=None``)."""
    from transformers import GPT2Config, GPT2Model

    from analysis.memory.dataflow import INPUT
    from analysis.memory.importer import default_loss

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=4, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2Model(cfg).train()
    ids = torch.randint(0, 100, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    for inputs, n_inputs in [({"input_ids": ids, "attention_mask": mask, "use_cache": False}, 2),
                             ({"input_ids": ids, "attention_mask": None}, 1)]:
        g, traced = import_training_step(model, inputs, optimizer="sgd")
        assert len(kinds(g, INPUT)) == n_inputs
        _, _, (loss,) = measure_fx_peak(traced.gm, *copy.deepcopy(traced.args))
        expected = default_loss(model(**inputs))
        torch.testing.assert_close(loss, expected.detach())
    g, traced = import_eval_step(model, {"input_ids": ids, "attention_mask": mask})
    assert len(kinds(g, INPUT)) == 2
