"""Models as users write them by hand, not from a library: nanoGPT (Karpathy's ``model.py``, its
structure and defaults: fused attention with ``dropout=0.0``, the output re-laid out with
``transpose(1, 2).contiguous().view(B, T, C)``, bias-free LayerNorm, tied embedding and head,
targets already shifted with ``-1`` ignored); and a translation model on ``nn.Transformer`` as
PyTorch's tutorial writes it (a causal ``tgt_mask`` from ``generate_square_subsequent_mask``,
padding masks, dropout)."""

from __future__ import annotations

import math
from typing import NamedTuple, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from .batches import VOCAB, Batch, BatchMaker


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has none to turn off)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = heads, d, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(d, bias)
        self.attn = CausalSelfAttention(d, heads, dropout, bias)
        self.ln_2 = LayerNorm(d, bias)
        self.mlp = MLP(d, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LossOutput(NamedTuple):
    """What a hand-written model returns: its logits and, given targets, its loss."""

    logits: torch.Tensor
    loss: torch.Tensor | None


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT``: ``forward(idx, targets)``, the head tied to the token embedding."""

    def __init__(
        self, vocab: int = VOCAB, block_size: int = 64, layers: int = 2, heads: int = 4, d: int = 32,
        dropout: float = 0.0, bias: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, d),
                wpe=nn.Embedding(block_size, d),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList([Block(d, heads, dropout, bias) for _ in range(layers)]),
                ln_f=LayerNorm(d, bias),
            )
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @property
    def wte(self) -> nn.Embedding:
        return cast(nn.Embedding, self.transformer["wte"])

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> LossOutput:
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        parts = self.transformer
        x = parts["drop"](self.wte(idx) + parts["wpe"](pos))
        for block in cast(nn.ModuleList, parts["h"]):
            x = block(x)
        logits = self.lm_head(parts["ln_f"](x))
        if targets is None:
            return LossOutput(logits, None)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return LossOutput(logits, loss)


def nanogpt_batch() -> BatchMaker:
    """nanoGPT's ``get_batch``: windows of a token stream, targets the window shifted by one; a
    document end in the last row's targets is ``-1`` (ignored)."""

    def make(b: int, n: int, seed: int) -> Batch:
        stream = torch.randint(0, VOCAB, (b, n + 1), generator=torch.Generator().manual_seed(seed))
        targets = stream[:, 1:].clone()
        targets[-1, -max(1, n // 4) :] = -1
        return {"idx": stream[:, :-1].contiguous(), "targets": targets}

    return make


PAD = 0


class TransformerTranslator(nn.Module):
    """``nn.Transformer`` with token embeddings, learned positions and a generator head; the loss
    is cross-entropy over the next target tokens, padding ignored."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.transformer = nn.Transformer(d, heads, layers, layers, 2 * d, dropout=0.1, batch_first=True)
        self.generator = nn.Linear(d, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        n = tgt.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=src.device)
        hidden = self.transformer(
            self.embed(src) + self.pos[: src.shape[1]],
            self.embed(tgt) + self.pos[:n],
            tgt_mask=mask,
            src_key_padding_mask=src == PAD,
            tgt_key_padding_mask=tgt == PAD,
            memory_key_padding_mask=src == PAD,
        )
        logits = self.generator(hidden)
        return LossOutput(logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=PAD))


def translation_batch() -> BatchMaker:
    """Source and target sentences, the last row of each padded; the target fed shifted right."""

    def make(b: int, n: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(1, VOCAB, (b, n), generator=g)
        tgt = torch.randint(1, VOCAB, (b, n + 1), generator=g)
        src[-1, -max(1, n // 4) :] = PAD
        tgt[-1, -max(1, n // 3) :] = PAD
        return {"src": src, "tgt": tgt[:, :-1].contiguous(), "labels": tgt[:, 1:].contiguous()}

    return make


class WordLSTM(nn.Module):
    """PyTorch's ``examples/word_language_model`` ``RNNModel`` (LSTM): embedding, dropout, a
    two-layer ``nn.LSTM`` with dropout between its layers, dropout, a decoder tied to the
    embedding; the hidden state starts at zeros each batch; the loss over the next tokens."""

    def __init__(self, d: int = 32, layers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(VOCAB, d)
        self.rnn = nn.LSTM(d, d, layers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(d, VOCAB)
        self.decoder.weight = self.encoder.weight  # tie_weights, as the example's --tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> LossOutput:
        output, _ = self.rnn(self.drop(self.encoder(idx)))
        logits = self.decoder(self.drop(output))
        return LossOutput(logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1))
