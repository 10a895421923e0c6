"""The zoo's batches: what a training loop passes each family (``model(**batch)``), every input a
tokenizer or feature extractor gives (padding in the last row) and the labels, from a seeded
generator so that every run sees the same data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Batch = dict[str, Any]
BatchMaker = Callable[[int, int, int], Batch]
VOCAB = 256
NUM_LABELS = 10
IMAGE = 32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids_mask(b: int, n: int, pad: int, g: torch.Generator, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (no special ids) and an attention mask; the last row is padded at its end, as
    a tokenizer pads the shorter text of a batch."""
    ids = torch.randint(4, vocab, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    keep = n - max(1, n // 4)
    mask[-1, keep:] = 0
    ids[-1, keep:] = pad
    return ids, mask


def _segments(mask: torch.Tensor) -> torch.Tensor:
    """token_type_ids of a sentence pair: 0 for the first half, 1 for the second, 0 on padding."""
    types = torch.zeros_like(mask)
    types[:, mask.shape[1] // 2 :] = 1
    return types * mask


def _padded_labels(b: int, n: int, low: int, high: int, g: torch.Generator) -> torch.Tensor:
    """Target ids with the last row's end ignored (-100)."""
    labels = torch.randint(low, high, (b, n), generator=g)
    labels[-1, n - max(1, n // 3) :] = -100
    return labels


def mlm_batch(pad: int = 0, token_types: bool = True, mask_id: int = 3) -> BatchMaker:
    """Masked LM: about 15% of the real tokens (at least one per row) masked and labelled."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = _gen(seed)
        ids, mask = _ids_mask(b, n, pad, g)
        chosen = (torch.rand(ids.shape, generator=g) < 0.15) & mask.bool()
        chosen[:, 1] = True
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        batch = {"input_ids": ids.masked_fill(chosen, mask_id), "attention_mask": mask}
        if token_types:
            batch["token_type_ids"] = _segments(mask)
        return {**batch, "labels": labels}

    return make


def cls_batch(num_labels: int = 3, pad: int = 0, token_types: bool = True) -> BatchMaker:
    """Sequence classification: one label per row."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = _gen(seed)
        ids, mask = _ids_mask(b, n, pad, g)
        batch = {"input_ids": ids, "attention_mask": mask}
        if token_types:
            batch["token_type_ids"] = _segments(mask)
        return {**batch, "labels": torch.randint(0, num_labels, (b,), generator=g)}

    return make


def rtd_batch() -> BatchMaker:
    """ELECTRA's replaced-token detection: a 0/1 label per token."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = _gen(seed)
        ids, mask = _ids_mask(b, n, 0, g)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "token_type_ids": _segments(mask),
            "labels": torch.randint(0, 2, (b, n), generator=g),
        }

    return make


def clm_batch(pad: int = 0) -> BatchMaker:
    """Causal LM: the labels are the ids (the model shifts them), -100 on padding."""

    def make(b: int, n: int, seed: int) -> Batch:
        ids, mask = _ids_mask(b, n, pad, _gen(seed))
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return make


def seq2seq_batch(pad: int = 0) -> BatchMaker:
    """Encoder-decoder: source ids and mask, target labels half as long (the model makes the
    decoder inputs from them)."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = _gen(seed)
        ids, mask = _ids_mask(b, n, pad, g)
        return {"input_ids": ids, "attention_mask": mask, "labels": _padded_labels(b, max(3, n // 2), 4, VOCAB, g)}

    return make


def image_batch(key: str = "pixel_values", size: int | None = None) -> BatchMaker:
    """Images (batch, 3, size, size), ``IMAGE`` by default, and a class per image; ``length`` is
    not used."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = _gen(seed)
        side = size or IMAGE
        return {
            key: torch.randn(b, 3, side, side, generator=g),
            "labels": torch.randint(0, NUM_LABELS, (b,), generator=g),
        }

    return make


def pixel_batch(size: int | None = None) -> BatchMaker:
    """Images alone (a self-supervised model takes no labels: ViT-MAE's loss is its own)."""

    def make(b: int, n: int, seed: int) -> Batch:
        side = size or IMAGE
        return {"pixel_values": torch.randn(b, 3, side, side, generator=_gen(seed))}

    return make


def image_text_batch() -> BatchMaker:
    """Captions and images for a contrastive model (CLIP): ids, mask, pixels, ``return_loss``."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = _gen(seed)
        ids, mask = _ids_mask(b, n, 0, g)
        pixels = torch.randn(b, 3, IMAGE, IMAGE, generator=g)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "return_loss": True}

    return make


def ctc_batch(samples_per_step: int = 20, vocab: int = 32) -> BatchMaker:
    """Raw audio (``length * 20`` samples, the last row padded with zeros and masked) and CTC
    character targets."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = _gen(seed)
        total = n * samples_per_step
        values = torch.randn(b, total, generator=g)
        mask = torch.ones(b, total, dtype=torch.long)
        keep = total - total // 4
        mask[-1, keep:] = 0
        values[-1, keep:] = 0
        return {"input_values": values, "attention_mask": mask, "labels": _padded_labels(b, 4, 1, vocab, g)}

    return make


def whisper_batch(mels: int = 16, frames: int = 32) -> BatchMaker:
    """Log-mel features of the fixed length Whisper's encoder takes, and target labels whose
    length follows ``length``."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = _gen(seed)
        return {
            "input_features": torch.randn(b, mels, frames, generator=g),
            "labels": _padded_labels(b, max(3, n // 2), 4, 100, g),
        }

    return make


# --- the registry -----------------------------------------------------------------------------
