"""Simulated peak vs the CPU allocator's measured peak of the same eager training step.

The measurement runs the step eagerly under torch.profiler (profile_memory=True) and follows
every allocation and free; the simulator sees only the traced graph. On a GPT-2 block the peak
falls inside autograd nodes (MulBackward0 of the tanh-GELU keeps its saved input and its
formula's temporaries to the node's end): a graph that frees at the last reader is ~5% low
there, the one with PyTorch's own release points is exact.
"""
import pytest
import torch
from transformers import BertConfig, GPT2Config
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from analysis.memory.allocator import allocator_peak, held_bytes, measure_training_step
from analysis.memory.importer import fx_to_dataflow, trace_training_step
from analysis.memory.simulate import simulate
from analysis.models import SmallCNN

TOLERANCE = 0.01


def _case(name: str) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    if name == "mlp":
        return (torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 64)), [torch.randn(32, 64)])
    if name == "cnn":
        return SmallCNN(8).train(), [torch.randn(4, 3, 16, 16)]
    if name == "bert-layer":
        cfg = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=256,
                         attn_implementation="eager")
        return BertLayer(cfg).train(), [torch.randn(4, 32, 64)]
    cfg = GPT2Config(n_embd=64, n_head=4, n_positions=64)
    return GPT2Block(cfg).train(), [torch.randn(4, 32, 64)]


def test_allocator_peak_counts_temporaries_and_not_earlier_memory():
    x = torch.ones(1000)  # 4000 bytes held by the caller: the baseline
    res = allocator_peak(lambda t: (t * t).sum(), x)
    assert res.baseline == 4000
    assert res.peak == 4000 + 4000 + 4  # x, the product, the sum (the product still alive)
    assert res.peak_op == "aten::sum"
    view = x[:10]
    assert held_bytes([x, view]) == 4000  # a view shares its base's storage


@pytest.mark.parametrize("name", ["mlp", "cnn", "bert-layer", "gpt2-block"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_simulated_peak_matches_allocator(name, optimizer):
    model, inputs = _case(name)
    g = fx_to_dataflow(trace_training_step(model, inputs, optimizer=optimizer))
    measured = measure_training_step(model, inputs, optimizer=optimizer)
    assert measured.baseline == g.resident_bytes()
    assert abs(simulate(g).peak - measured.peak) <= TOLERANCE * measured.peak


def test_gpt2_block_peak_needs_autograd_release_points():
    """Without the release points the simulator misses the temporaries of the backward of
    GELU's multiplications (the issue's 2.6-5.2%); with them it is exact to a few bytes."""
    model, inputs = _case("gpt2-block")
    traced = trace_training_step(model, inputs)
    measured = measure_training_step(model, inputs).peak
    last_reader = simulate(fx_to_dataflow(traced, eager_lifetimes=False)).peak
    g = fx_to_dataflow(traced)
    assert last_reader < 0.97 * measured
    assert abs(simulate(g).peak - measured) <= 64  # bytes: scalars the graph keeps as constants
    held = {g.nodes[h].op for e in g.edges.values() for h in e.holders}
    assert "aten.mul.Tensor" in held  # held to the end of a MulBackward0


class TiedEmbedding(torch.nn.Module):
    """One embedding read twice (as T5 shares its embedding): two gradients for it to add."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20000, 32)
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(a)) + self.emb(b)


def test_engine_adds_gradients_in_place():
    """Autograd's engine sums the two embedding gradients into the first one's buffer; on fake
    tensors it allocates a new one, which the importer turns back into the in-place sum."""
    torch.manual_seed(0)
    model = TiedEmbedding()
    inputs = [torch.randint(0, 20000, (4, 16)), torch.randint(0, 20000, (4, 16))]
    traced = trace_training_step(model, inputs, optimizer="sgd")
    measured = measure_training_step(model, inputs, optimizer="sgd").peak
    assert simulate(fx_to_dataflow(traced, eager_lifetimes=False)).peak > 1.2 * measured
    assert abs(simulate(fx_to_dataflow(traced)).peak - measured) <= TOLERANCE * measured
    assert traced.accumulations  # the engine's sums were seen
