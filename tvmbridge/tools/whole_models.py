"""Whole transformers models with their loss, called as a training loop calls them.

Each task is a model built from a config (random weights: nothing is downloaded) and the inputs
of its ordinary training call, labels included, so that the loss is computed inside the model
(and so inside the compiled graph). ``small`` configs are for tests, ``base`` ones for the
benchmark. Language-model batches carry padding (attention mask zeros, label ``-100``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

WHOLE_MODELS = ("bert-mlm", "gpt2-lm", "vit-cls", "resnet-cls")


@dataclass
class TrainingTask:
    """A model and the arguments of one training call (``model(*args, **kwargs).loss``)."""

    name: str
    model: torch.nn.Module
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def call(self, model: torch.nn.Module | None = None) -> Any:
        return (model or self.model)(*self.args, **self.kwargs)


def _padded_ids(vocab: int, batch: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask whose later rows are padded (the last row to half length)."""
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(1, batch):
        keep = max(1, seq - row * seq // (2 * max(batch - 1, 1)))
        mask[row, keep:] = 0
        ids[row, keep:] = 0
    return ids, mask


def _bert_mlm(size: str, batch: int, seq: int, gen: torch.Generator) -> TrainingTask:
    import transformers

    small = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=120,
        max_position_embeddings=128,
    )
    cfg = transformers.BertConfig(**(small if size == "small" else {}))
    model = transformers.BertForMaskedLM(cfg)
    ids, mask = _padded_ids(cfg.vocab_size, batch, seq, gen)
    labels = torch.full_like(ids, -100)
    chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & mask.bool()
    chosen[:, 1] = True  # at least one label per row
    labels[chosen] = ids[chosen]
    return TrainingTask("bert-mlm", model, (ids, mask), {"labels": labels})


def _gpt2_lm(size: str, batch: int, seq: int, gen: torch.Generator) -> TrainingTask:
    import transformers

    small = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=120, n_positions=128, bos_token_id=0, eos_token_id=0)
    cfg = transformers.GPT2Config(**(small if size == "small" else {}))
    model = transformers.GPT2LMHeadModel(cfg)
    ids, mask = _padded_ids(cfg.vocab_size, batch, seq, gen)
    labels = ids.masked_fill(mask == 0, -100)
    return TrainingTask("gpt2-lm", model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels})


def _vit_cls(size: str, batch: int, seq: int, gen: torch.Generator) -> TrainingTask:
    import transformers

    small = dict(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    cfg = transformers.ViTConfig(num_labels=10, **(small if size == "small" else {}))
    model = transformers.ViTForImageClassification(cfg)
    pixels = torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return TrainingTask("vit-cls", model, (pixels,), {"labels": labels})


def _resnet_cls(size: str, batch: int, seq: int, gen: torch.Generator) -> TrainingTask:
    import transformers

    small = dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    cfg = transformers.ResNetConfig(num_labels=10, **(small if size == "small" else {}))
    model = transformers.ResNetForImageClassification(cfg)
    side = 32 if size == "small" else 224
    pixels = torch.randn(batch, 3, side, side, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return TrainingTask("resnet-cls", model, (pixels,), {"labels": labels})


_BUILDERS = {"bert-mlm": _bert_mlm, "gpt2-lm": _gpt2_lm, "vit-cls": _vit_cls, "resnet-cls": _resnet_cls}


def build_task(name: str, size: str = "small", batch: int = 2, seq: int = 16, seed: int = 0) -> TrainingTask:
    """The task ``name`` (one of :data:`WHOLE_MODELS`) in train mode, weights from ``seed``."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(WHOLE_MODELS)}")
    if size not in ("small", "base"):
        raise ValueError(f"size must be 'small' or 'base', not {size!r}")
    torch.manual_seed(seed)
    task = _BUILDERS[name](size, batch, seq, torch.Generator().manual_seed(seed))
    task.model.train()
    return task
