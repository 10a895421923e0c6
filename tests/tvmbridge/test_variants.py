"""One dispatch serving a training loop: a compiled variant per call signature, chosen by guards."""
from __future__ import annotations

import copy
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
    # 7 compiles a variant symbolic in the batch, which the later 4 and 7 use (the last variant
    # used is tried first); 1 is outside its range (export specializes sizes 0 and 1)
    assert [v.calls for v in d.variants] == [1, 3, 1] and d.calls_fallback == 0
    assert [v.symbolic for v in d.variants] == [False, True, False]
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
    add_tvm_dispatch(m, (torch.randn(4, 16),), dynamic=False)  # a variant per shape: more compiles to race
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


# --- symbolic dimensions -------------------------------------------------------------------------
def _bert_layer():
    from analysis.models import bert_layer

    torch.manual_seed(0)
    return bert_layer(64, 4, 128)


def _bert_call(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    from analysis.models import bert_layer_inputs

    return bert_layer_inputs(batch, seq, 64)


def test_dynamic_padding_loop_compiles_twice_and_matches_pytorch():
    """Every batch padded to its longest sequence: the second length compiles one symbolic
    variant that serves every later length; outputs, masks and every gradient are PyTorch's."""
    m = _bert_layer()
    ref = clone_module(m)
    add_tvm_dispatch(m, _bert_call(2, 10))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        for seq in (10, 7, 12, 5, 16, 9):
            _same_step(m, ref, _bert_call(2, seq), tol=2e-5)
    d = m._tvm_dispatch
    assert len(d.variants) == 2 and d.calls_fallback == 0, d.explain()
    assert d.variants[1].symbolic and not d.variants[0].symbolic
    assert [v.calls for v in d.variants] == [1, 5]
    assert "symbolic in (2, s" in d.variants[1].why
    # the last stage's module (kept by a compile loaded from the disk cache too) holds the offload
    offloaded = d.variants[1].compiled.stages["fast_math"].script()
    assert "R.matmul(" not in offloaded and "tvmbridge." in offloaded  # symbolic GEMMs on the library too


def test_symbolic_guard_checks_relations_and_ranges():
    m = _bert_layer().eval()
    ref = clone_module(m)
    add_tvm_dispatch(m, _bert_call(2, 10))
    _same_step(m, ref, _bert_call(3, 12))  # batch and length differ: both symbolic
    d = m._tvm_dispatch
    assert d.variants[1].symbolic and len(d.variants) == 2
    x, _ = _bert_call(2, 9)
    _, mask = _bert_call(2, 11)  # a mask of another length: no compiled code fits, PyTorch says why
    with pytest.raises(RuntimeError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(x, mask)
    _same_step(m, ref, _bert_call(2, 1))  # length 1 is outside the symbolic range [2, ...]
    assert "outside the compiled range" in d.variants[-1].why


def test_marked_dynamic_dims_compile_symbolic_from_the_first_call():
    m = _bert_layer()
    ref = clone_module(m)
    dyn = {"hidden_states": {1: "seq"}, "attention_mask": {3: "seq"}}
    add_tvm_dispatch(m, _bert_call(2, 10), dynamic=dyn)
    for seq in (10, 13, 6):
        _same_step(m, ref, _bert_call(2, seq), tol=2e-5)
    assert len(m._tvm_dispatch.variants) == 1 and m._tvm_dispatch.variants[0].symbolic
    with pytest.raises(ConversionError, match="not tensor arguments"):
        add_tvm_dispatch(_bert_layer(), _bert_call(2, 10), dynamic={"hidden": {1: "seq"}})


def test_dynamic_false_compiles_exact_shapes():
    torch.manual_seed(0)
    m = Block()
    add_tvm_dispatch(m, (torch.randn(4, 16),), dynamic=False)
    m(torch.randn(5, 16))
    m(torch.randn(6, 16))
    assert len(m._tvm_dispatch.variants) == 3 and not any(v.symbolic for v in m._tvm_dispatch.variants)
    with pytest.raises(ValueError, match="option dynamic"):
        add_tvm_dispatch(Block(), dynamic="yes")


def _one_symbolic_variant(m: nn.Module, image: tuple[int, int, int], batches: tuple[int, ...],
                          dtype: torch.dtype = torch.float32) -> nn.Module:
    """``m`` dispatched at batch 2, then stepped at ``batches`` next to a copy in PyTorch (conv
    weight grads sum over batch x pixels: float rounding ~1e-5); asserts one symbolic variant
    served every later batch. Returns the PyTorch copy."""
    torch.manual_seed(0)
    ref = clone_module(m)
    add_tvm_dispatch(m, (torch.randn(2, *image, dtype=dtype),))
    for batch in batches:
        _same_step(m, ref, (torch.randn(batch, *image, dtype=dtype),), tol=5e-5)
    d = m._tvm_dispatch
    assert d.dynamic_failure is None and len(d.variants) == 2 and d.variants[1].symbolic, d.explain()
    assert d.variants[1].calls == len(batches)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_norm_in_train_mode_serves_every_batch_size_from_one_symbolic_variant(dtype):
    """Train-mode BatchNorm divides by its element count, read from the shape at run time where
    the batch is symbolic: one variant for every later batch size (it was an exact variant per
    size), its outputs, gradients and running statistics as ATen's."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
                      nn.Linear(6 * 5 * 5, 8), nn.BatchNorm1d(8), nn.ReLU()).to(dtype).train()
    ref = _one_symbolic_variant(m, (3, 5, 5), (6, 3, 5, 4), dtype)
    for (name, a), b in zip(m.named_buffers(), ref.buffers()):
        assert torch.allclose(a.double(), b.double(), atol=1e-6), name


class _Pools(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv(x)), 3, 2, 1)
        return F.avg_pool2d(h, 3, 2, 1, ceil_mode=True).flatten(1)


def test_pooling_gradients_serve_a_symbolic_batch():
    """The bridge's max-pool and ceil-mode average-pool gradients (a scatter over each image's
    plane) take a symbolic batch: one variant for the later batch sizes (a ResNet stem's
    max-pool kept every CNN on exact variants)."""
    torch.manual_seed(0)
    _one_symbolic_variant(_Pools().train(), (3, 9, 9), (3, 5, 4))


class _PadDrop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 7 * 7, 6)
        self.drop = nn.Dropout(0.25, inplace=True)  # as MobileNetV2: its mask buffer is empty_permuted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(F.relu(self.conv(x)), (1, 1, 1, 1))  # spatial padding only: the batch stays free
        return self.fc(self.drop(h.flatten(1)))


def test_padding_and_dropout_serve_a_symbolic_batch():
    """A constant pad's gradient slices only the padded axes, and a dropout's mask buffer
    (``empty_permuted``) takes a symbolic batch: one variant for later batch sizes (MobileNetV2's
    symbolic compile failed on both)."""
    torch.manual_seed(0)
    _one_symbolic_variant(_PadDrop().train(), (3, 7, 7), (3, 5, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_norm_serves_a_symbolic_batch(dtype):
    """GroupNorm reshapes by the input's own batch size and its gradient needs static sizes after
    the batch only: one variant for the later batch sizes (it compiled an exact one per size)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Flatten()).to(dtype).train()
    _one_symbolic_variant(m, (3, 6, 6), (3, 5, 4), dtype)


class _PooledConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x)).mean((2, 3))


def test_a_failing_symbolic_compile_falls_back_to_exact_shapes():
    """Relax's convolution gradient needs static image sizes: a symbolic height and width are
    refused, so each size compiles exactly (and those dims are not tried symbolic again)."""
    torch.manual_seed(0)
    m = _PooledConv().train()
    ref = clone_module(m)
    add_tvm_dispatch(m, (torch.randn(2, 3, 6, 6),))
    for size in (5, 7):
        _same_step(m, ref, (torch.randn(2, 3, size, size),), tol=5e-5)
    d = m._tvm_dispatch
    assert d.dynamic_failure is not None
    assert len(d.variants) == 3 and not any(v.symbolic for v in d.variants)
    # the symbolic compile is tried once, not again for the next size
    assert "a symbolic compile failed" in d.variants[1].why and "symbolic" not in d.variants[2].why


@pytest.mark.parametrize("kind", ["drop_path", "randn_like", "dropout2d"])
def test_random_ops_in_a_symbolic_variant_draw_at_the_call_sizes(kind):
    """Random values whose shape is symbolic are drawn at each call's sizes, as eager draws them."""
    from .test_trust import Noisy

    torch.manual_seed(0)
    m = Noisy(kind)
    ref = clone_module(m)
    add_tvm_dispatch(m, (torch.randn(2, 3, 6, 6),))
    for batch in (3, 4, 2, 5):  # conv weight grads sum over batch x pixels: float rounding ~1e-5
        _same_step(m, ref, (torch.randn(batch, 3, 6, 6),), tol=5e-5)
    d = m._tvm_dispatch
    assert len(d.variants) == 2 and d.variants[1].symbolic, d.explain()
    # a symbolic image size: Relax's conv2d gradient needs static spatial sizes, so that compile
    # fails and this size gets an exact variant; the batch stays symbolic for later calls
    _same_step(m, ref, (torch.randn(3, 3, 5, 5),), tol=5e-5)
    _same_step(m, ref, (torch.randn(4, 3, 5, 5),), tol=5e-5)
    assert "a symbolic compile failed" in d.variants[2].why and d.variants[3].symbolic, d.explain()


def test_a_symbolic_variant_trims_the_memory_pool_as_new_sizes_arrive(monkeypatch):
    """TVM's pooled allocator keeps freed buffers by exact size: a loop over many lengths would
    keep a set per length. After a few distinct sizes the pool is released before the call."""
    import tvmbridge.runtime.dispatch as dispatch

    released = []
    monkeypatch.setattr(dispatch, "release_cached_memory", lambda: released.append(1))
    torch.manual_seed(0)
    m = Block().eval()
    ref = clone_module(m)
    add_tvm_dispatch(m, (torch.randn(4, 16),), dynamic={"x": [0]})
    assert m._tvm_dispatch.variants[0].symbolic
    for batch in (4, 5, 6, 7, 4, 5, 8, 9, 10, 11, 12, 8):
        x = torch.randn(batch, 16)
        with torch.no_grad():
            assert torch.allclose(m(x), ref(x), atol=1e-5)
    # sizes 4..7 fill the window; 8 trims (window {8}); 9, 10, 11 fill it; 12 trims; 8 is new again
    assert len(released) == 2


def test_identical_layers_share_one_compile_and_keep_their_own_weights():
    """Separately dispatched layers with equal graphs (a model's repeated blocks) reuse one
    compile; the state is an input, so each computes with its own weights."""
    from tvmbridge.caches import CACHES

    layers = [_bert_layer() for _ in range(2)]
    torch.manual_seed(1)
    layers[1] = _bert_layer().apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    assert not torch.equal(layers[0].output.dense.weight, layers[1].output.dense.weight)
    refs = [clone_module(m) for m in layers]
    args = _bert_call(2, 10)
    for m in layers:
        add_tvm_dispatch(m, args)
    first, second = (m._tvm_dispatch.variants[0] for m in layers)
    assert "reused" in second.compiled.compile_seconds and "reused" not in first.compiled.compile_seconds
    assert second.compiled.executable is first.compiled.executable and CACHES.compiles.hits == 1
    for m, ref in zip(layers, refs):
        _same_step(m, ref, args, tol=2e-5)
    other = _bert_layer()
    other.attention.self.dropout.p = 0.3  # another graph: its own compile
    add_tvm_dispatch(other, args)
    assert "reused" not in other._tvm_dispatch.variants[0].compiled.compile_seconds


def test_a_symbolic_compile_that_does_not_fit_its_call_compiles_that_shape(monkeypatch, tmp_path):
    """nanoGPT's loop (batch 4 and 3, length 32 and 24) with the disk cache on: a symbolic compile
    for a call came back as an earlier variant's graph (the length static), did not fit the call
    it was compiled for, and each such call ran PyTorch while the same variant was compiled again
    until the cache was full."""
    from tvmbridge.tools.zoo.handwritten import NanoGPT

    monkeypatch.setenv("TVMBRIDGE_DISK_CACHE", "1")
    monkeypatch.setenv("TVMBRIDGE_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    m = NanoGPT(block_size=32)
    ref = clone_module(m)
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    add_tvm_dispatch(m, (ids[:, :32].contiguous(), ids[:, 1:].contiguous()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        for b, t in [(4, 24), (3, 24), (4, 32), (3, 32), (4, 24)]:
            x, y = ids[:b, :t].contiguous(), ids[:b, 1 : t + 1].contiguous()
            got, want = m(x, y).loss, ref(x, y).loss
            assert is_tvm(got), m._tvm_dispatch.explain()
            torch.testing.assert_close(got, want)
            got.backward()
    assert m._tvm_dispatch.calls_fallback == 0, m._tvm_dispatch.explain()


class UnsqueezedHeads(nn.Module):
    """GPTBigCode's multi-query split: ``h.unsqueeze(1)`` viewed to ``(b, n, -1, head_dim)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        b, n, _ = x.shape
        h = self.lin(x).unsqueeze(1).view(b, n, -1, 8)
        return (h * h.softmax(-1)).sum(-1)


def test_a_view_to_symbolic_sizes_compiles_symbolic():
    """TVM's view converter compared a size 1 with a symbolic length by Python truth and failed:
    every new shape compiled for itself. One symbolic variant now serves them, as PyTorch."""
    torch.manual_seed(0)
    m = UnsqueezedHeads()
    ref = clone_module(m)
    add_tvm_dispatch(m, verify=False)
    for shape in ((2, 5, 16), (3, 7, 16), (4, 2, 16)):
        x = torch.randn(shape)
        errs = max_errors(run_step(m, (x,)), run_step(ref, (x,)))
        assert max(errs.values()) < 1e-5, errs
    d = m._tvm_dispatch
    assert len(d.variants) == 2 and d.variants[1].symbolic and d.variants[1].calls == 2, d.explain()


class ThirdOfLinear(nn.Module):
    """Creates a tensor without a dtype: it takes torch's default dtype, and the output with it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.full((4,), 1.0 / 3.0)


def test_a_default_dtype_changed_after_compiling_compiles_again_and_back_reuses() -> None:
    """``torch.set_default_dtype(torch.float64)`` after a variant was trusted: it kept returning
    float32 computed with a float32 third where PyTorch returns float64 (a global state the
    compiled code depends on, as torch.compile guards it)."""
    from tvmbridge import compile_inference

    torch.manual_seed(0)
    ref = ThirdOfLinear()
    m = add_tvm_dispatch(clone_module(ref), (torch.randn(3, 4),))
    x = torch.randn(3, 4)
    for _ in range(3):
        m(x).sum().backward()
    m.zero_grad()
    infer = compile_inference(clone_module(ref), (x,))
    try:
        torch.set_default_dtype(torch.float64)
        got, want = m(x), ref(x)
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        assert "default dtype is torch.float64" in m._tvm_dispatch.variants[-1].why
        with pytest.raises(ValueError, match="default dtype"):
            infer(x)
    finally:
        torch.set_default_dtype(torch.float32)
    n = len(m._tvm_dispatch.variants)
    assert m(x).dtype == torch.float32 and len(m._tvm_dispatch.variants) == n  # the first variant again


class Counted(torch.nn.Module):
    """A forward that reads a counter the training loop bumps, the graph the same whatever it is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step < 0:  # a warm-up branch, never taken here: the counter is read
            x = x * 0.5
        return self.lin(x).relu()


def test_state_that_changes_every_call_without_changing_the_graph_is_said_once() -> None:
    """Every attribute the forward read is checked, so a counter the loop bumps sends each call
    through a new trace (of a graph compiled before): right numbers, a trace per step. The third
    such trace says so, once, naming the attribute."""
    torch.manual_seed(0)
    m, x = Counted(), torch.randn(4, 8)
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m, (x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            torch.testing.assert_close(m(x), ref(x))
            m.step += 1
    said = [str(w.message) for w in caught if issubclass(w.category, RecompileWarning)]
    assert len(said) == 1 and "traced again 3 times" in said[0]
    assert "Counted.step is 3, compiled for 2" in said[0]
