"""The model zoo shared by the tools, tests, demo and benchmarks (random weights, no download).

Every entry of :data:`MODELS` is a builder ``(batch=..., device="cpu", **sizes) -> (model,
inputs)``: the module in train mode (dropout and batch norm behave as in training) and example
inputs keyed by forward parameter name. ``device="meta"`` gives inputs that hold no data; the
model itself is built wherever the caller is (inside ``analysis.MetaTensorMode`` it allocates
nothing). :func:`build` is the seeded form the benchmarks use.

:func:`bert_layer` and :func:`bert_layer_inputs` are the one BertLayer (and its padded-batch
inputs) every part of the project uses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ModelAndArgs = tuple[nn.Module, dict[str, torch.Tensor]]
SEQ = 128  # sequence length of the memory benchmark's language models


def bert_config(
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    intermediate: int | None = None,
    vocab: int | None = None,
    attn: str | None = "eager",
) -> Any:
    """A ``transformers.BertConfig``; ``attn="eager"`` is the attention the bridge converts
    (``None`` keeps transformers' default, SDPA)."""
    from transformers import BertConfig

    extra = {} if vocab is None else {"vocab_size": vocab}
    cfg = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate or 4 * hidden,
        **extra,
    )
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def bert_layer(
    hidden: int = 768,
    heads: int = 12,
    intermediate: int | None = None,
    dtype: torch.dtype = torch.float32,
    attn: str | None = "eager",
) -> nn.Module:
    """One ``transformers`` BertLayer in train mode (BERT-base sizes by default)."""
    from transformers.models.bert.modeling_bert import BertLayer

    return BertLayer(bert_config(hidden, 1, heads, intermediate, attn=attn)).train().to(dtype)


def bert_layer_inputs(
    batch: int = 1,
    seq: int = 14,
    hidden: int = 768,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden_states, attention_mask)`` for a padded batch: the last quarter of the positions
    (at least one) masked with the dtype's lowest value, as transformers builds its masks."""
    x = torch.randn(batch, seq, hidden, dtype=dtype, generator=generator)
    mask = torch.zeros(batch, 1, 1, seq, dtype=dtype)
    mask[..., seq - max(1, seq // 4) :] = torch.finfo(dtype).min
    return x, mask


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


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with batch norm and a (projected) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet18(nn.Module):
    """ResNet-18 layout (2-2-2-2 basic blocks, 64..512 channels) for 3x`size`x`size` images."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        layers, cin = [], 64
        for cout, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class Seq2Seq(nn.Module):
    """torch.nn.Transformer small (2+2 layers, d_model 256) on pre-embedded sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(
            d_model=256, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=1024, batch_first=True
        )

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.t(src, tgt)


def _randn(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.empty(*shape, device="meta") if device == "meta" else torch.randn(*shape, device=device)


def _ids(vocab: int, *shape: int, device: str = "cpu") -> torch.Tensor:
    if device == "meta":
        return torch.empty(*shape, dtype=torch.long, device="meta")
    return torch.randint(0, vocab, shape, device=device)


# --- builders: (batch, device, sizes) -> (model, inputs by parameter name) -----------------------
def bert(batch: int = 8, seq: int = 128, hidden: int = 768, heads: int = 12, device: str = "cpu") -> ModelAndArgs:
    """One BertLayer with transformers' default attention (what users profile)."""
    return bert_layer(hidden, heads, attn=None), {"hidden_states": _randn(batch, seq, hidden, device=device)}


def bert_encoder(
    batch: int = 8, seq: int = 128, hidden: int = 768, heads: int = 12, layers: int = 12, device: str = "cpu"
) -> ModelAndArgs:
    """A ``transformers`` BertEncoder: the stack of ``layers`` BertLayers of BERT-base."""
    from transformers.models.bert.modeling_bert import BertEncoder

    model = BertEncoder(bert_config(hidden, layers, heads, attn=None)).train()
    return model, {"hidden_states": _randn(batch, seq, hidden, device=device)}


def gpt2_block(batch: int = 8, seq: int = 128, hidden: int = 768, heads: int = 12, device: str = "cpu") -> ModelAndArgs:
    """One ``transformers`` GPT2Block (GPT-2 small sizes by default)."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = GPT2Block(GPT2Config(n_embd=hidden, n_head=heads, n_positions=max(seq, 1024))).train()
    return model, {"hidden_states": _randn(batch, seq, hidden, device=device)}


def small_cnn(batch: int = 8, size: int = 32, channels: int = 16, device: str = "cpu") -> ModelAndArgs:
    """`SmallCNN` on ``batch`` RGB images of ``size`` x ``size``."""
    return SmallCNN(channels).train(), {"x": _randn(batch, 3, size, size, device=device)}


def mlp(batch: int = 8, device: str = "cpu") -> ModelAndArgs:
    """784-1024-1024-1024-10 with ReLUs."""
    model = nn.Sequential(
        nn.Linear(784, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )
    return model, {"input": _randn(batch, 784, device=device)}


def resnet18(batch: int = 8, size: int = 224, device: str = "cpu") -> ModelAndArgs:
    return ResNet18(), {"x": _randn(batch, 3, size, size, device=device)}


def bert4(batch: int = 8, seq: int = SEQ, device: str = "cpu") -> ModelAndArgs:
    """A 4-layer BertModel, hidden 256, vocab 8000, no pooler."""
    from transformers import BertModel

    cfg = bert_config(256, 4, 4, 1024, vocab=8000, attn=None)
    return BertModel(cfg, add_pooling_layer=False), {"input_ids": _ids(8000, batch, seq, device=device)}


def gpt2_small(batch: int = 8, seq: int = SEQ, device: str = "cpu") -> ModelAndArgs:
    """GPT-2 small (12 layers, 768 wide)."""
    from transformers import GPT2Config, GPT2Model

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
    return GPT2Model(cfg), {"input_ids": _ids(cfg.vocab_size, batch, seq, device=device)}


def vit_s6(batch: int = 8, size: int = 224, device: str = "cpu") -> ModelAndArgs:
    """ViT with 6 layers, hidden 384, patch 16, no pooler."""
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        intermediate_size=1536,
        image_size=size,
        patch_size=16,
    )
    return ViTModel(cfg, add_pooling_layer=False), {"pixel_values": _randn(batch, 3, size, size, device=device)}


def transformer(batch: int = 8, seq: int = SEQ, device: str = "cpu") -> ModelAndArgs:
    return Seq2Seq(), {"src": _randn(batch, seq, 256, device=device), "tgt": _randn(batch, seq, 256, device=device)}


MODELS: dict[str, Callable[..., ModelAndArgs]] = {
    "bert": bert,
    "bert-encoder": bert_encoder,
    "gpt2": gpt2_block,
    "cnn": small_cnn,
    "mlp": mlp,
    "resnet18": resnet18,
    "bert4": bert4,
    "gpt2-small": gpt2_small,
    "vit-s6": vit_s6,
    "nn.Transformer": transformer,
}
MEMORY_BENCHMARK = ("mlp", "resnet18", "bert4", "gpt2-small", "vit-s6", "nn.Transformer")


def sizes_accepted(name: str, sizes: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``sizes`` that model ``name``'s builder takes (a CLI passes all it has)."""
    params = inspect.signature(MODELS[name]).parameters
    return {k: v for k, v in sizes.items() if k in params}


def build(name: str, batch: int, **sizes: Any) -> tuple[nn.Module, list[torch.Tensor]]:
    """Model ``name`` (see :data:`MODELS`) with random weights (seed 0) and inputs for ``batch``."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; have {sorted(MODELS)}")
    torch.manual_seed(0)
    model, inputs = MODELS[name](batch=batch, **sizes)
    return model, list(inputs.values())
