"""compile_inference: whole models forward-only on TVM, weights bound as constants."""
from __future__ import annotations

import pytest
import torch

from tvmbridge import compile_inference
from tvmbridge.tools.whole_models import build_task


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= tol * (1 + b.abs().max().item())


def test_bert_model_matches_pytorch_and_combines_qkv():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, vocab_size=200)
    model = transformers.BertModel(cfg)  # left in train mode: compile_inference uses eval and restores it
    ids = torch.randint(0, 200, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    f = compile_inference(model, (ids, mask))
    assert model.training
    out = f(ids, mask)
    with torch.no_grad():
        want = model.eval()(ids, mask)
    assert type(out) is type(want)
    assert _close(out.last_hidden_state, want.last_hidden_state) and _close(out.pooler_output, want.pooler_output)
    script = f.stages.script()
    # per layer 6 GEMMs with Q/K/V combined into one (8 without), plus the pooler
    assert script.count("call_pure_packed") == 2 * 6 + 1


@pytest.mark.parametrize("name", ["gpt2-lm", "vit-cls", "resnet-cls"])
def test_whole_models_match_pytorch(name):
    task = build_task(name)
    kwargs = {k: v for k, v in task.kwargs.items() if k != "labels"}
    f = compile_inference(task.model, task.args, kwargs)
    out = f(*task.args, **kwargs)
    with torch.no_grad():
        want = task.model.eval()(*task.args, **kwargs)
    assert _close(out.logits, want.logits)


def test_other_shapes_are_refused_with_a_clear_error():
    task = build_task("vit-cls")
    f = compile_inference(task.model, task.args)
    with pytest.raises(ValueError, match="compiled for .* shape"):
        f(torch.randn(3, 3, 16, 16))


def test_weights_are_a_snapshot():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    f = compile_inference(lin, (x,))
    before = lin(x).detach()
    with torch.no_grad():
        lin.weight.add_(1.0)
    assert _close(f(x), before)


def test_index_out_of_range_raises():
    emb = torch.nn.Embedding(10, 4)
    f = compile_inference(emb, (torch.tensor([1, 2]),))
    with pytest.raises(IndexError):
        f(torch.tensor([1, 10]))


def test_a_call_under_another_autocast_or_with_another_value_is_refused():
    """The guard is the dispatcher's (one check, written once): autocast and non-tensor values too."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
            return self.lin(x) * scale

    m, x = Scaled(), torch.randn(2, 4)
    f = compile_inference(m, (x,), {"scale": 3.0})
    assert torch.allclose(f(x, scale=3.0), m(x, scale=3.0), atol=1e-6)
    with pytest.raises(ValueError, match="scale is 4.0, compiled for 3.0"):
        f(x, scale=4.0)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
        f(x, scale=3.0)
