"""Per-module FLOPs of `FlopCounter` on transformers models and ``nn.Transformer`` (small
configs, random weights, nothing downloaded), by fully qualified module name, against PyTorch's
``FlopCounterMode`` where both count, and by hand where PyTorch's attribution is off."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from analysis.profiling.flops import GLOBAL, FlopCounter, is_torch_counted

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

Built = tuple[torch.nn.Module, tuple, dict[str, Any]]


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 8))


def _bert() -> Built:  # default attention (SDPA): in training, with dropout, the math kernel
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64)
    return transformers.BertModel(cfg, add_pooling_layer=False), (_ids(),), {}


def _gpt2() -> Built:
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  attn_implementation="eager")
    return transformers.GPT2Model(cfg), (_ids(),), {}


def _t5() -> Built:
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return transformers.T5Model(cfg), (), {"input_ids": _ids(), "decoder_input_ids": _ids()}


def _vit() -> Built:
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, image_size=16, patch_size=8,
                                 attn_implementation="eager")
    return transformers.ViTModel(cfg, add_pooling_layer=False), (torch.randn(2, 3, 16, 16),), {}


def _nn_transformer() -> Built:
    model = torch.nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                 dim_feedforward=64, batch_first=True)
    return model, (torch.randn(2, 8, 32), torch.randn(2, 8, 32)), {}


# builder, and the path of the repeated layer (a ModuleList item) below the root
MODELS: dict[str, tuple[Callable[[], Built], str]] = {
    "bert": (_bert, "encoder.layer"),
    "gpt2": (_gpt2, "h"),
    "t5": (_t5, "encoder.block"),
    "vit": (_vit, "layers"),
    "nn.Transformer": (_nn_transformer, "encoder.layers"),
}


def _build(name: str) -> Built:
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name][0]()
    return model.train(), args, kwargs


def _main_output(out: Any) -> torch.Tensor:
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    return out[0] if isinstance(out, tuple) else out


def _torch_counted(ops: dict) -> dict:
    return {k: v for k, v in ops.items() if is_torch_counted(k) and v}


def _per_module(counts: dict[str, dict]) -> dict[str, dict]:
    return {m: _torch_counted(ops) for m, ops in counts.items() if _torch_counted(ops)}


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_per_module_equals_pytorch(name: str) -> None:
    model, args, kwargs = _build(name)
    with torch.no_grad(), FlopCounterMode(display=False) as ref:
        model(*args, **kwargs)
    with torch.no_grad(), FlopCounter() as fc:
        model(*args, **kwargs)
    ours = _per_module({m: fc.by_op(m, "forward") for m in fc.counts})
    assert ours == _per_module(ref.get_flop_counts())
    # fully qualified names: each list item has its own entry, under the root's class name
    root, layers = type(model).__name__, MODELS[name][1]
    assert all(m in (GLOBAL, root) or m.startswith(root + ".") for m in fc.counts)
    first, second = f"{root}.{layers}.0", f"{root}.{layers}.1"
    assert ours[first] and ours[first] == ours[second]  # the two layers are the same shapes
    assert sum(fc.total("forward", m) for m in (first, second)) <= fc.total("forward", root)


@pytest.mark.parametrize("name", list(MODELS))
def test_backward_per_module_by_hand(name: str) -> None:
    """Every module's backward is twice its forward in the ops PyTorch counts: a product
    ``y = a @ b`` (linear, bmm, convolution) costs ``da = dy @ b.T`` and ``db = a.T @ dy`` in
    backward, each as many multiply-adds as the forward, when both need a gradient (float
    inputs require grad here, so everything does).

    PyTorch's per-module backward differs on purpose: ModuleTracker counts a module from the
    moment all its outputs have gradients until all its inputs have them, so it charges BERT's
    key projection with the value projection's backward, leaves BertAttention without its
    output dense's (the attention-weights output never gets a gradient, so the module opens
    late) and, for T5, charges the shared embedding (input ids need no gradient, so it never
    closes) with the rest of the backward. Only the totals are compared with it."""
    model, args, kwargs = _build(name)
    args = tuple(a.requires_grad_() if a.is_floating_point() else a for a in args)
    with FlopCounterMode(display=False) as ref:
        _main_output(model(*args, **kwargs)).sum().backward()
    with FlopCounter() as fc:
        _main_output(model(*args, **kwargs)).sum().backward()
    assert _torch_counted(fc.by_op()) == _torch_counted(ref.get_flop_counts()[GLOBAL])
    for m in fc.counts:
        fwd = sum(_torch_counted(fc.by_op(m, "forward")).values())
        assert sum(_torch_counted(fc.by_op(m, "backward")).values()) == 2 * fwd, m
    layer0 = f"{type(model).__name__}.{MODELS[name][1]}.0"
    assert fc.total("backward", layer0) > 0


def test_module_list_and_dict_items_keep_their_paths() -> None:
    """The issue's example: two Linears in a ModuleList were both "Linear" and merged."""

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)])
            self.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 2)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.heads["a"](x)

    with torch.no_grad(), FlopCounter() as fc:
        M()(torch.randn(8, 4))
    # addmm: 2 FLOPs per multiply-add (8 rows), bias adds included in it as in PyTorch
    assert fc.by_module("forward") == {GLOBAL: 1792, "M": 1792, "M.layers.0": 512,
                                       "M.layers.1": 1024, "M.heads.a": 256}


def test_checkpointed_layers_recompute_in_their_own_modules() -> None:
    """transformers' gradient checkpointing (non-reentrant, early stop): each layer's forward
    runs again in backward, counted for that layer's modules and their parents only (the
    recomputation runs inside the layer's last LayerNorm's backward node, which must not take
    it), and a forward after the backward is not charged to the last re-run module."""
    plain, args, _ = _build("bert")
    ckpt, _, _ = _build("bert")
    enable = getattr(ckpt, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers < 5
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    other = torch.nn.Linear(32, 32)
    counters = []
    for model in (plain, ckpt):
        torch.manual_seed(0)
        with FlopCounter() as fc:
            _main_output(model(*args)).sum().backward()
            other(torch.randn(4, 32))
        counters.append(fc)
    a, b = counters
    assert set(b.counts) == set(a.counts) and b.by_op("Linear") == a.by_op("Linear")
    for m in set(a.counts) - {GLOBAL, "Linear"}:  # those two also hold `other`'s forward
        fwd = _torch_counted(a.by_op(m, "forward"))
        assert _torch_counted(b.by_op(m, "forward")) == fwd, m
        before, after = _torch_counted(a.by_op(m, "backward")), _torch_counted(b.by_op(m, "backward"))
        extra = {op: after.get(op, 0) - before.get(op, 0) for op in set(before) | set(after)}
        assert {op: n for op, n in extra.items() if n} == fwd, m  # the layers' forward, again
