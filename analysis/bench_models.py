"""Model zoo for the memory benchmark: small configs, random weights, nothing downloaded.

Each entry builds (model, example inputs for a batch size). Sizes are kept modest so that a
whole training step traces in seconds on a CPU with fake tensors.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

SEQ = 128


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with batch norm and a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                    nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet18(nn.Module):
    """ResNet-18 layout (2-2-2-2 basic blocks, 64..512 channels) for 3x`size`x`size` images."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _mlp(batch: int):
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                          nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return model, [torch.randn(batch, 784)]


def _resnet(batch: int):
    return ResNet18(), [torch.randn(batch, 3, 224, 224)]


def _bert(batch: int):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024, vocab_size=8000)
    return BertModel(cfg, add_pooling_layer=False), [torch.randint(0, 8000, (batch, SEQ))]


def _gpt2(batch: int):
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)  # GPT-2 small
    return GPT2Model(cfg), [torch.randint(0, cfg.vocab_size, (batch, SEQ))]


def _vit(batch: int):
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
                    intermediate_size=1536, image_size=224, patch_size=16)
    return ViTModel(cfg, add_pooling_layer=False), [torch.randn(batch, 3, 224, 224)]


class _Seq2Seq(nn.Module):
    """torch.nn.Transformer small (2+2 layers, d_model 256) on pre-embedded sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(d_model=256, nhead=4, num_encoder_layers=2,
                                num_decoder_layers=2, dim_feedforward=1024, batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.t(src, tgt)


def _transformer(batch: int):
    return _Seq2Seq(), [torch.randn(batch, SEQ, 256), torch.randn(batch, SEQ, 256)]


MODELS: dict[str, Callable[[int], tuple[nn.Module, list[torch.Tensor]]]] = {
    "mlp": _mlp,
    "resnet18": _resnet,
    "bert4": _bert,
    "gpt2-small": _gpt2,
    "vit-s6": _vit,
    "nn.Transformer": _transformer,
}


def build(name: str, batch: int) -> tuple[nn.Module, list[torch.Tensor]]:
    """Model `name` (see MODELS) with random weights and inputs for `batch`."""
    if name not in MODELS:
        raise KeyError(f"unknown benchmark model {name!r}; have {sorted(MODELS)}")
    torch.manual_seed(0)
    return MODELS[name](batch)
