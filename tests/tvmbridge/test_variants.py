"""One dispatch serving a training loop: a compiled variant per call signature, chosen by guards."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tvmbridge import ConversionError, FallbackWarning, RecompileWarning, add_tvm_dispatch

from ..helpers import clone_module, is_tvm, max_errors, run_step


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x, mask=None):
        h = self.drop(F.gelu(self.fc1(x)))
        if mask is not None:
            h = h * mask
        return self.fc2(h)


def _same_step(m: nn.Module, ref: nn.Module, args: tuple, tol: float = 1e-5) -> None:
    got, want = run_step(m, args), run_step(ref, args)
    assert is_tvm(got[0][0]), "the call ran PyTorch"
    errs = max_errors(got, want)
    assert max(errs.values()) <= tol, errs


def test_no_sample_compiles_on_first_call_and_every_shape_after():
    torch.manual_seed(0)
    m = Block()
    ref = clone_module(m)
    add_tvm_dispatch(m)
    assert m._tvm_dispatch.variants == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        for batch in (4, 7, 4, 7, 1):
            _same_step(m, ref, (torch.randn(batch, 16),))
    d = m._tvm_dispatch
    assert [v.calls for v in d.variants] == [2, 2, 1] and d.calls_fallback == 0
    assert d.variants[0].why == "first call" and "x dim 0 is 7, compiled for 4" in d.variants[1].why
    text = d.explain()
    assert "variant 3 (train: x (1, 16) float32): 1 calls" in text


def test_train_and_eval_variants_coexist_and_precompile_ahead_of_time():
    torch.manual_seed(0)
    m = Block()
    ref = clone_module(m)
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    m.eval()
    m._tvm_dispatch.precompile(x)  # ahead of time, in eval mode
    assert len(m._tvm_dispatch.variants) == 2
    for mode in ("eval", "train", "eval", "train"):
        m.train(mode == "train"); ref.train(mode == "train")
        _same_step(m, ref, (x,))
    assert [v.calls for v in m._tvm_dispatch.variants] == [2, 2]


def test_keyword_tensor_and_constant_variants():
    """``mask=None`` (the default, given or not) is one signature; a mask tensor is another."""
    torch.manual_seed(0)
    m = Block()
    ref = clone_module(m)
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    _same_step(m, ref, (x, None))
    assert len(m._tvm_dispatch.variants) == 1
    mask = (torch.rand(4, 32) > 0.5).float()
    with pytest.warns(RecompileWarning, match=r"mask=<tensor \(4, 32\) float32> is given, compiled with it left at its default"):
        got, want = run_step(m, (x, mask)), run_step(ref, (x, mask))
    assert is_tvm(got[0][0]) and max(max_errors(got, want).values()) <= 1e-5
    assert "mask=<tensor (4, 32) float32> is given" in m._tvm_dispatch.variants[1].why


def test_concurrent_calls_with_new_shapes_compile_each_once():
    """Threads meeting new shapes at once: one compile per shape, every result PyTorch's (calls
    wait while another thread traces: torch.export patches every module call process-wide)."""
    torch.manual_seed(0)
    m = Block().eval()
    ref = clone_module(m)
    add_tvm_dispatch(m, (torch.randn(4, 16),))
    inputs = {b: torch.randn(b, 16) for b in (4, 5, 6, 7)}
    with torch.no_grad():
        want = {b: ref(x) for b, x in inputs.items()}
    errors: list[str] = []

    def call(order: list[int]) -> None:
        for b in order:
            try:
                with torch.no_grad():
                    got = m(inputs[b])
                if not torch.allclose(got, want[b], atol=1e-5):
                    errors.append(f"batch {b}: wrong result")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"batch {b}: {exc!r}")

    orders = [[5, 6, 7, 4], [6, 5, 4, 7], [7, 7, 5, 6], [5, 5, 6, 6]]
    threads = [threading.Thread(target=call, args=(o,)) for o in orders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d = m._tvm_dispatch
    assert not errors, errors
    assert len(d.variants) == 4 and d.calls_tvm == 16 and d.calls_fallback == 0, d.explain()


class Pooled(nn.Module):
    """Compiles for ``indices=False``; the other signature returns max-pool indices, which the
    bridge refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x, indices=False):
        return F.max_pool2d(self.conv(x), 2, return_indices=indices)


def test_a_failed_variant_warns_once_runs_pytorch_and_is_not_retried():
    torch.manual_seed(0)
    m = Pooled()
    ref = clone_module(m)
    x = torch.randn(2, 2, 8, 8)
    add_tvm_dispatch(m, (x,))
    with pytest.warns(FallbackWarning, match="compiling a variant for this call failed: .*indices") as rec, \
            pytest.warns(RecompileWarning, match="indices=True is given"):
        out, idx = m(x, indices=True)
        m(x, indices=True)
    assert len([w for w in rec if issubclass(w.category, FallbackWarning)]) == 1
    want, want_idx = ref(x, indices=True)
    assert torch.equal(idx, want_idx) and torch.allclose(out, want)
    d = m._tvm_dispatch
    assert len(d.failures) == 1 and d.calls_fallback == 2 and len(d.variants) == 1
    assert is_tvm(m(x))  # the compiled signature still runs


def test_a_failing_first_compile_raises_without_fallback():
    m = Pooled()
    add_tvm_dispatch(m)
    with pytest.raises(ConversionError, match="indices"):
        m(torch.randn(2, 2, 8, 8), indices=True)
    lenient = Pooled()
    add_tvm_dispatch(lenient, fallback=True)
    with pytest.warns(FallbackWarning, match="indices"):
        lenient(torch.randn(2, 2, 8, 8), indices=True)


def test_cache_size_limit_is_an_option_with_a_check():
    with pytest.raises(ValueError, match="cache_size_limit"):
        add_tvm_dispatch(Block(), cache_size_limit=0)


def test_bert_encoder_called_by_bert_model_runs_compiled():
    """The call a parent really makes: BertModel calls its encoder with ``use_cache=False`` (the
    default is None) and ``position_ids=None`` through ``**kwargs``: a second variant, with a
    warning naming the difference; a sample written like the parent's call compiles once."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        vocab_size=50, max_position_embeddings=32, attn_implementation="eager")
    model = BertModel(config, add_pooling_layer=False).train()
    ref = clone_module(model)
    ids = torch.randint(0, 50, (2, 10))
    add_tvm_dispatch(model.encoder, (torch.randn(2, 10, 32),))
    torch.manual_seed(1)
    with pytest.warns(RecompileWarning, match="use_cache=False is given"):
        got = model(input_ids=ids).last_hidden_state
    got.sum().backward()
    torch.manual_seed(1)
    want = ref(input_ids=ids).last_hidden_state
    want.sum().backward()
    d = model.encoder._tvm_dispatch
    assert d.calls_tvm == 1 and d.calls_fallback == 0, d.explain()
    assert (got - want).abs().max().item() <= 1e-4
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max().item() <= 1e-4, name

    model.encoder.remove_tvm_dispatch()
    add_tvm_dispatch(model.encoder, (torch.randn(2, 10, 32),), {"use_cache": False, "position_ids": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids)
    assert len(model.encoder._tvm_dispatch.variants) == 1 and model.encoder._tvm_dispatch.calls_tvm == 1
