"""Small built-in models for the profiler CLI, tests and benchmarks (random weights, no download).

Each builder returns ``(model, meta_args)``: the module (in train mode, so dropout and batch norm
behave as in training) and example inputs keyed by forward parameter name. Pass
``device="meta"`` for inputs that hold no data; the model itself is built wherever the caller
is (inside `analysis.MetaTensorMode` it allocates nothing).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ModelAndArgs = tuple[nn.Module, dict[str, torch.Tensor]]


class SmallCNN(nn.Module):
    """conv-bn-relu-pool twice, global pooling, linear: the ops a vision model profile needs."""

    def __init__(self, channels: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.bn1(self.conv1(x))))
        x = self.pool2(self.relu2(self.bn2(self.conv2(x))))
        return self.fc(torch.flatten(x, 1))


def _bert_config(hidden: int, layers: int, heads: int) -> Any:
    from transformers import BertConfig

    return BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=4 * hidden)


def bert_layer(batch: int = 8, seq: int = 128, hidden: int = 768, heads: int = 12,
               device: str = "cpu") -> ModelAndArgs:
    """One ``transformers`` BertLayer (BERT-base sizes by default)."""
    from transformers.models.bert.modeling_bert import BertLayer

    model = BertLayer(_bert_config(hidden, 1, heads)).train()
    return model, {"hidden_states": _input(batch, seq, hidden, device)}


def bert_encoder(batch: int = 8, seq: int = 128, hidden: int = 768, heads: int = 12,
                 layers: int = 12, device: str = "cpu") -> ModelAndArgs:
    """A ``transformers`` BertEncoder: the stack of ``layers`` BertLayers of BERT-base."""
    from transformers.models.bert.modeling_bert import BertEncoder

    model = BertEncoder(_bert_config(hidden, layers, heads)).train()
    return model, {"hidden_states": _input(batch, seq, hidden, device)}


def gpt2_block(batch: int = 8, seq: int = 128, hidden: int = 768, heads: int = 12,
               device: str = "cpu") -> ModelAndArgs:
    """One ``transformers`` GPT2Block (GPT-2 small sizes by default)."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = GPT2Block(GPT2Config(n_embd=hidden, n_head=heads, n_positions=max(seq, 1024))).train()
    return model, {"hidden_states": _input(batch, seq, hidden, device)}


def small_cnn(batch: int = 8, size: int = 32, channels: int = 16, device: str = "cpu") -> ModelAndArgs:
    """`SmallCNN` on ``batch`` RGB images of ``size`` x ``size``."""
    model = SmallCNN(channels).train()
    shape = (batch, 3, size, size)
    return model, {"x": torch.randn(*shape, device=device) if device != "meta"
                   else torch.empty(*shape, device="meta")}


def _input(batch: int, seq: int, hidden: int, device: str) -> torch.Tensor:
    if device == "meta":
        return torch.empty(batch, seq, hidden, device="meta")
    return torch.randn(batch, seq, hidden, device=device)


MODELS: dict[str, Callable[..., ModelAndArgs]] = {
    "bert": bert_layer,
    "bert-encoder": bert_encoder,
    "gpt2": gpt2_block,
    "cnn": small_cnn,
}
