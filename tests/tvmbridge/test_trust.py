"""Never silently wrong: each case a careful user hits, against plain PyTorch (outputs and every
gradient), or the clear error / warned fallback the bridge gives instead."""
from __future__ import annotations

import copy
import io
import pickle
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tvmbridge import ConversionError, FallbackWarning, UnsupportedOpError, add_tvm_dispatch

from tvmbridge.runtime.function import overlapping, unalias

from ..helpers import clone_module, is_tvm, max_errors, relative_errors, run_step


def _compare(module: nn.Module, args: tuple, tol: float = 1e-5, **opts) -> nn.Module:
    """Dispatch ``module`` and check one step (fixed seeds) against its PyTorch copy (errors
    relative to each tensor's magnitude)."""
    ref = clone_module(module)
    add_tvm_dispatch(module, args, **opts)
    got, want = run_step(module, args), run_step(ref, args)
    assert is_tvm(got[0][0]), module._tvm_dispatch.explain()
    errs = relative_errors(got, want)
    assert max(errs.values()) <= tol, errs
    return ref


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(2 * d)

    def forward(self, x):
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


# --- threads -------------------------------------------------------------------------------------
def test_four_threads_hundred_calls_with_grads_all_exact():
    torch.manual_seed(0)
    m = Block()
    ref = clone_module(m)
    xs = [torch.randn(4, 16) for _ in range(8)]
    add_tvm_dispatch(m, (xs[0],))
    want = {}
    for i, x in enumerate(xs):
        x = x.clone().requires_grad_()
        out = ref(x)
        want[i] = (out.detach(), *torch.autograd.grad(out.square().sum(), [x, *ref.parameters()]))
    errors: list[str] = []

    def work(tid: int) -> None:
        for k in range(100):
            i = (tid + k) % len(xs)
            x = xs[i].clone().requires_grad_()
            out = m(x)
            got = (out.detach(), *torch.autograd.grad(out.square().sum(), [x, *m.parameters()]))
            if not is_tvm(out):
                errors.append("fell back")
            elif any((a - b).abs().max().item() > 1e-5 for a, b in zip(got, want[i])):
                errors.append(f"thread {tid} call {k} wrong")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert m._tvm_dispatch.calls_tvm == 400


# --- module state ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [1, 2])
def test_batchnorm_eval_uses_running_statistics(dims):
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(6) if dims == 1 else nn.BatchNorm2d(6)
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
    m = nn.Sequential(bn, nn.ReLU()).eval()
    x = torch.randn(4, 6) if dims == 1 else torch.randn(4, 6, 5, 5)
    _compare(m, (x,))


@pytest.mark.parametrize("shape", [(8, 6, 5), (4, 6, 6, 6), (8, 6)], ids=["1d-NCL", "2d", "1d-NC"])
def test_batchnorm_train_updates_running_statistics_like_pytorch(shape):
    """Running statistics as ATen's CPU kernel computes them: bit for bit where it sums each
    channel in double (inputs with a spatial dimension); an (N, C) input, which ATen sums in
    per-thread float partials, to float rounding."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.BatchNorm1d(6) if len(shape) < 4 else nn.BatchNorm2d(6), nn.ReLU()).train()
    x = torch.randn(*shape)
    ref = _compare(m, (x,), tol=1e-5)
    for i in range(10):  # more steps: the statistics keep following PyTorch's
        for mod in (m, ref):
            mod(x * (1 + i) + i)
    for (name, a), (_, b) in zip(m.named_buffers(), ref.named_buffers()):
        if len(shape) > 2 or name.endswith("num_batches_tracked"):
            assert torch.equal(a, b), name
        else:
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), name
    assert int(m[0].num_batches_tracked) == 11 and m._tvm_dispatch.calls_tvm == 11


def test_load_state_dict_changing_a_buffer_is_seen():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).eval()
    x = torch.randn(3, 4)
    add_tvm_dispatch(m, (x,))
    sd = copy.deepcopy(m.state_dict())
    sd["1.running_mean"] = torch.randn(6)
    sd["1.running_var"] = torch.rand(6) + 0.5
    m.load_state_dict(sd)
    ref = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).eval()
    ref.load_state_dict(sd)
    out = m(x)
    assert is_tvm(out) or m._tvm_dispatch.calls_tvm == 1
    assert torch.allclose(out, ref(x), atol=1e-5)


def test_replaced_parameter_is_used_and_gets_the_grad():
    torch.manual_seed(0)
    m = Block()
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    old = m.fc1.weight
    m.fc1.weight = nn.Parameter(torch.randn_like(old))
    ref = clone_module(m)
    ref.remove_tvm_dispatch()
    out = m(x)
    out.sum().backward()
    ref(x).sum().backward()
    assert is_tvm(out)
    assert old.grad is None and m.fc1.weight.grad is not None
    assert torch.allclose(m.fc1.weight.grad, ref.fc1.weight.grad, atol=1e-5)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.scale = 2.0

    def forward(self, x):
        return self.drop(self.fc(x)) * self.scale


@pytest.mark.parametrize("change,why", [("dropout p", "drop.p is 0.5"), ("python float", "scale is 3.0"),
                                        ("submodule eval", "drop.training is False")])
def test_changed_module_attributes_compile_a_new_variant(change, why):
    """A changed attribute is never stale: the call compiles a variant that reads the new value."""
    torch.manual_seed(0)
    m = Scaled()
    x = torch.randn(4, 8)
    add_tvm_dispatch(m, (x,))
    if change == "dropout p":
        m.drop.p = 0.5
    elif change == "python float":
        m.scale = 3.0
    else:
        m.drop.eval()
    ref = clone_module(m)
    ref.remove_tvm_dispatch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        torch.manual_seed(3)
        got = m(x)
    torch.manual_seed(3)
    want = ref(x)
    assert is_tvm(got) and torch.equal(got == 0, want == 0) and torch.allclose(got, want, atol=1e-5)
    assert len(m._tvm_dispatch.variants) == 2 and why in m._tvm_dispatch.variants[1].why


def test_hook_on_a_submodule_runs_pytorch():
    """Hooks do not run inside compiled code, and compiling again would not help: PyTorch runs."""
    torch.manual_seed(0)
    m = Scaled()
    x = torch.randn(4, 8)
    add_tvm_dispatch(m, (x,))
    m.fc.register_forward_hook(lambda mod, i, o: o * 0)
    ref = clone_module(m)
    ref.remove_tvm_dispatch()
    with pytest.warns(FallbackWarning, match="fell back to PyTorch for Scaled: fc _forward_hooks"):
        torch.manual_seed(3)
        got = m(x)
    torch.manual_seed(3)
    assert torch.equal(got, ref(x)) and not is_tvm(got)
    assert "ran PyTorch" in m._tvm_dispatch.explain() and len(m._tvm_dispatch.variants) == 1


def test_fallback_warns_once_per_reason_and_can_be_silenced():
    """A full variant cache: the call runs PyTorch, saying which limit and what differed."""
    m = Block()
    add_tvm_dispatch(m, (torch.randn(4, 16),), cache_size_limit=1)
    with pytest.warns(FallbackWarning, match="cache_size_limit; x dim 0 is 5, compiled for 4") as rec:
        m(torch.randn(5, 16))
        m(torch.randn(5, 16))
    assert len([w for w in rec if issubclass(w.category, FallbackWarning)]) == 1
    assert m._tvm_dispatch.calls_fallback == 2 and len(m._tvm_dispatch.variants) == 1
    quiet = Block()
    add_tvm_dispatch(quiet, (torch.randn(4, 16),), warn_on_fallback=False, cache_size_limit=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        quiet(torch.randn(5, 16))
    assert "dim 0 is 5" in quiet._tvm_dispatch.explain()


# --- randomness --------------------------------------------------------------------------------------
class Noisy(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.drop = {"dropout1d": nn.Dropout1d(0.3), "dropout2d": nn.Dropout2d(0.3),
                     "alpha": nn.AlphaDropout(0.3)}.get(kind, nn.Identity())

    def forward(self, x):
        h = self.conv(x)
        if self.kind == "dropout1d":
            return self.drop(h.flatten(2))
        if self.kind == "randn_like":
            return h + 0.1 * torch.randn_like(h)
        if self.kind == "drop_path":
            keep = h.new_empty(h.shape[0], 1, 1, 1).bernoulli_(0.7)
            return h * keep / 0.7
        if self.kind == "channels_last":
            return F.dropout(h.contiguous(memory_format=torch.channels_last), 0.4, training=True)
        return self.drop(h)


@pytest.mark.parametrize("kind", ["dropout1d", "dropout2d", "alpha", "randn_like", "drop_path", "channels_last"])
def test_random_ops_draw_per_call_like_pytorch(kind):
    torch.manual_seed(0)
    m = Noisy(kind).train()
    x = torch.randn(8, 3, 6, 6)
    _compare(m, (x,))
    torch.manual_seed(5)
    outs = [m(x) for _ in range(3)]
    assert all(is_tvm(o) for o in outs)
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])  # never frozen
    assert outs[0].abs().sum() > 0


class DeadDraws(nn.Module):
    """Random values the output never reads (a discarded branch, as CANINE's final character
    encoder under a classifier), drawn before a dropout that it does read."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        F.dropout(h * 2, 0.3, training=True)  # discarded
        torch.rand_like(h)  # discarded
        h.new_empty(h.shape[0], 1).bernoulli_(0.5)  # discarded
        return F.dropout(h, 0.5, training=True) * 3


def test_random_values_nothing_reads_are_still_drawn_like_pytorch():
    """Eager draws a discarded dropout's mask too: the compiled call draws the same stream, so the
    dropout it keeps gets eager's mask and the generator ends where eager's does."""
    torch.manual_seed(0)
    m = DeadDraws().train()
    tvm = clone_module(m)
    add_tvm_dispatch(tvm, verify=False)  # the raw compiled result, not the first-call net's fallback
    x = torch.randn(64, 6)
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = m(x)
        after_eager = torch.get_rng_state()
        torch.manual_seed(seed)
        got = tvm(x)
        assert is_tvm(got)
        assert torch.equal(torch.get_rng_state(), after_eager)
        torch.testing.assert_close(got, want)


def test_random_op_of_computed_values_is_refused():
    class Sample(nn.Module):
        def forward(self, p):
            return torch.bernoulli(torch.sigmoid(p))

    with pytest.raises(UnsupportedOpError, match="bernoulli"):
        add_tvm_dispatch(Sample(), (torch.randn(4),))


# --- autograd semantics -------------------------------------------------------------------------------
def test_gradient_penalty_create_graph():
    torch.manual_seed(0)
    m = Block()
    ref = clone_module(m)
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    grads = {}
    for name, mod in (("tvm", m), ("torch", ref)):
        xi = x.clone().requires_grad_()
        out = mod(xi)
        loss = out.square().mean()
        (gx,) = torch.autograd.grad(loss, xi, create_graph=True)
        (loss + gx.square().sum()).backward()
        grads[name] = [p.grad.clone() for p in mod.parameters()]
    for a, b in zip(grads["tvm"], grads["torch"]):
        assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def test_in_place_edit_of_an_output_the_backward_reads_raises():
    class Tanh(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    m = Tanh()
    x = torch.randn(3, 8)
    add_tvm_dispatch(m, (x,), capture="all")
    y = m(x)
    assert is_tvm(y)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("copy_op", ["clone", "contiguous_of_transpose", "to_same_dtype"])
def test_in_place_edit_of_a_copy_the_model_returns_is_as_eager(copy_op):
    """A model that returns a copy of a value its backward reads (``h.clone()``; a transposed
    view made contiguous): PyTorch's copy is apart from the saved value, so the user may edit it
    in place (``out[:, 0] = 0``, ``out.div_(t)``). TVM folds the copy into the value, and the
    guard that makes such an edit of the value itself raise, as PyTorch does, raised here too."""
    copies = {
        "clone": lambda h: h.clone(),
        "contiguous_of_transpose": lambda h: h.t().contiguous().t(),
        "to_same_dtype": lambda h: h.to(torch.float32, copy=True),
    }

    class CopyOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            return copies[copy_op](h), h.sum()

    torch.manual_seed(0)
    ref = CopyOut()
    m = add_tvm_dispatch(copy.deepcopy(ref), (torch.randn(3, 8),), verify=False)
    x = torch.randn(3, 8)
    grads = []
    for model in (m, ref):
        out, total = model(x)
        out.mul_(2)
        out[:, 0] = 0
        (out.square().sum() + total).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert m._tvm_dispatch.calls_tvm == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), min_size=0, max_size=12),
       st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), min_size=0, max_size=12))
def test_which_outputs_share_memory_with_captured_values_is_the_test_of_every_pair(outs, caps):
    """``overlapping`` (one sort, a binary search per output; the forward's in-place guard) says
    of each tensor what testing it against every other tensor says: views of one storage at any
    offsets and lengths (empty ones too), nested, touching, disjoint."""
    base = torch.zeros(80)

    def views(spans):
        return [base[start:start + n] for start, n in spans]

    def pair(a, b):
        if a.numel() == 0 or b.numel() == 0:
            return False
        a0, b0 = a.data_ptr(), b.data_ptr()
        return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()

    tensors, others = views(outs), views(caps)
    assert overlapping(tensors, others) == [any(pair(t, o) for o in others) for t in tensors]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), min_size=0, max_size=10),
       st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12), st.booleans()), min_size=0, max_size=6))
def test_results_sharing_memory_are_copied_as_a_test_of_every_pair_says(outs, owned_spans):
    """``unalias`` (one sort over address ranges) leaves no two results sharing memory and none
    over an owned tensor's storage (an owned view may start inside a result), and copies no
    result that overlaps nothing."""
    base = torch.zeros(80)
    results = [base[start:start + n] for start, n in outs]
    owned = [base[start:start + n] if compact else base[start:start + 2 * n:2] for start, n, compact in owned_spans]

    def span(t, whole):
        if whole:
            return t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()
        return t.data_ptr(), t.data_ptr() + (t.numel() - 1) * t.stride(0) * t.element_size() + t.element_size()

    def hits(a, b, whole):
        if a.numel() == 0 or b.numel() == 0:
            return False
        (a0, a1), (b0, b1) = span(a, False), span(b, whole)
        return a0 < b1 and b0 < a1

    got = unalias(results, owned)
    for i, (r, g) in enumerate(zip(results, got)):
        assert torch.equal(g, r)
        assert not any(hits(g, q, False) for q in got[:i]), (i, outs, owned_spans)
        assert not any(hits(g, o, True) for o in owned), (i, outs, owned_spans)
        alone = not any(hits(r, q, False) for j, q in enumerate(results) if j != i)
        if alone and not any(hits(r, o, True) for o in owned):
            assert g is r, (i, outs, owned_spans)


# --- ops the frontend got wrong ------------------------------------------------------------------------
def test_embedding_index_out_of_range_raises_like_pytorch():
    m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    ids = torch.tensor([[1, 2, 3]])
    _compare(m, (ids,))
    with pytest.raises(IndexError, match="index out of range"):
        m(torch.tensor([[1, 2, 10]]))
    with pytest.raises(IndexError, match="index out of range"):
        m(torch.tensor([[-1, 2, 3]]))


def test_embedding_padding_idx_gets_no_gradient():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 2))
    _compare(m, (torch.tensor([[0, 2, 0, 5]]),))


def test_avg_pool_divisor_override():
    class P(nn.Module):
        def forward(self, x):
            return F.avg_pool2d(x, 2, divisor_override=3)

    _compare(P(), (torch.randn(2, 3, 4, 4),))


def test_max_pool_indices_are_refused_not_wrong():
    class P(nn.Module):
        def forward(self, x):
            return F.max_pool2d(x, 2, return_indices=True)

    with pytest.raises(UnsupportedOpError, match="indices"):
        add_tvm_dispatch(P(), (torch.randn(1, 2, 4, 4),))


# --- autocast ---------------------------------------------------------------------------------------------
def test_call_under_autocast_runs_an_autocast_variant():
    """(More in test_autocast.py.) Autocast is no longer a fallback: the call compiles a variant
    traced under it, with autocast's dtypes."""
    m = Block()
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        out = m(x)
    assert out.dtype == torch.bfloat16 and is_tvm(out)
    assert len(m._tvm_dispatch.variants) == 2


def test_dispatched_under_autocast_then_called_without_it():
    torch.manual_seed(0)
    m = Block()
    ref = clone_module(m)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        add_tvm_dispatch(m, (x,))
        assert m(x).dtype == torch.bfloat16
    out = m(x)
    assert is_tvm(out) and out.dtype == torch.float32
    assert torch.allclose(out, ref(x), atol=1e-5)
    assert "autocast(cpu, bfloat16)" in m._tvm_dispatch.variants[0].label


# --- what used to crash ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_recompile_on_first_use(how):
    torch.manual_seed(0)
    m = Block()
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    if how == "deepcopy":
        c = copy.deepcopy(m)
    elif how == "pickle":
        c = pickle.loads(pickle.dumps(m))
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    assert c._tvm_dispatch is not m._tvm_dispatch and c._tvm_dispatch.module is c
    ref = clone_module(m)
    ref.remove_tvm_dispatch()
    got, want = run_step(c, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0]) and max(max_errors(got, want).values()) <= 1e-5
    assert m._tvm_dispatch.calls_tvm == 0  # the original is untouched
    c.remove_tvm_dispatch()
    assert not is_tvm(c(x.requires_grad_()))


def test_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    m = Tied()
    _compare(m, (torch.randn(3, 8),))
    m.b.weight = nn.Parameter(torch.randn(8, 8))  # untied after compiling: never stale
    ref = clone_module(m)
    ref.remove_tvm_dispatch()
    x = torch.randn(3, 8)
    got, want = run_step(m, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0]) and max(max_errors(got, want).values()) <= 1e-5
    assert "no longer tied" in m._tvm_dispatch.variants[-1].why


def test_integer_outputs_come_back_without_gradient():
    class Classify(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 5)

        def forward(self, x):
            logits = self.fc(x)
            return logits, logits.argmax(-1)

    torch.manual_seed(0)
    m = Classify()
    ref = clone_module(m)
    x = torch.randn(4, 8)
    add_tvm_dispatch(m, (x,))
    logits, labels = m(x.requires_grad_())
    assert is_tvm(logits) and labels.dtype == torch.int64 and not labels.requires_grad
    assert torch.equal(labels, ref(x)[1])
    logits.sum().backward()
    assert m.fc.weight.grad is not None


def test_zero_size_dimension_is_refused_clearly_and_empty_calls_run_pytorch():
    with pytest.raises(ConversionError, match="zero-size dimension") as err:
        add_tvm_dispatch(Block(), (torch.randn(0, 16),))
    assert err.value.stage == "inputs"
    torch.manual_seed(0)
    m = Block()
    ref = clone_module(m)
    add_tvm_dispatch(m, (torch.randn(4, 16),))
    x = torch.randn(0, 16, requires_grad=True)
    with pytest.warns(FallbackWarning, match="dim 0 is 0"):
        out = m(x)
    out.sum().backward()
    ref(x.detach()).sum().backward()
    assert not is_tvm(out) and torch.equal(m.fc1.bias.grad, ref.fc1.bias.grad)


def test_torch_compile_of_a_parent_graph_breaks_around_the_dispatched_child():
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(16, 16), Block(), nn.ReLU())
    ref = clone_module(parent)
    x = torch.randn(4, 16)
    add_tvm_dispatch(parent[1], (x,))
    compiled = torch.compile(parent, backend="aot_eager")
    out = compiled(x)
    assert torch.allclose(out, ref(x), atol=1e-5)
    assert parent[1]._tvm_dispatch.calls_tvm >= 1


# --- more of what users do -------------------------------------------------------------------------------------
def test_checkpoint_around_the_dispatched_module():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = Scaled()
    ref = clone_module(m)
    x = torch.randn(4, 8)
    add_tvm_dispatch(m, (x,))
    grads = {}
    for name, mod in (("tvm", m), ("torch", ref)):
        xi = x.clone().requires_grad_()
        torch.manual_seed(7)
        out = checkpoint(mod, xi, use_reentrant=False)
        out.square().sum().backward()
        grads[name] = [xi.grad, *[p.grad for p in mod.parameters()]]
    assert m._tvm_dispatch.calls_tvm == 2  # forward, and its recomputation in backward
    for a, b in zip(grads["tvm"], grads["torch"]):
        assert torch.allclose(a, b, atol=1e-5)


def test_backward_twice_with_retain_graph_and_once_more_without():
    torch.manual_seed(0)
    m = Block()
    ref = clone_module(m)
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    for mod in (m, ref):
        out = mod(x.clone().requires_grad_()).square().sum()
        out.backward(retain_graph=True)
        out.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.backward()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5)


def test_functional_call_with_other_parameters():
    torch.manual_seed(0)
    m = Block()
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    params = {n: torch.randn_like(p, requires_grad=True) for n, p in m.named_parameters()}
    out = torch.func.functional_call(m, params, (x,))
    plain = Block()
    plain.load_state_dict({n: p.detach() for n, p in params.items()})
    assert is_tvm(out) and torch.allclose(out, plain(x), atol=1e-5)
    out.sum().backward()
    assert params["fc1.weight"].grad is not None and m.fc1.weight.grad is None


def test_forward_mode_ad_falls_back_with_its_tangents():
    """The compiled Function has no ``jvp``: a call with dual tensors (an input's tangent, or a
    parameter's) runs PyTorch, with a warning; outside the dual level the compiled path again."""
    import torch.autograd.forward_ad as fwAD

    m = Block()
    x = torch.randn(4, 16)
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m, (x,))
    tangent = torch.randn_like(x)
    with fwAD.dual_level(), pytest.warns(FallbackWarning, match="forward-mode AD"):
        got = fwAD.unpack_dual(m(fwAD.make_dual(x, tangent)))
        want = fwAD.unpack_dual(ref(fwAD.make_dual(x, tangent)))
    assert torch.allclose(got.primal, want.primal) and torch.allclose(got.tangent, want.tangent)
    assert is_tvm(m(x.requires_grad_()))


def test_a_flop_counter_or_an_analysis_trace_sees_pytorch_ops():
    from torch.utils.flop_counter import FlopCounterMode

    m = Block()
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    with FlopCounterMode(display=False) as fc, pytest.warns(FallbackWarning, match="TorchDispatchMode"):
        m(x)
    assert fc.get_total_flops() == 2 * (2 * 4 * 16 * 32)
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # as the analysis tools run a module
        out = m(torch.empty(4, 16))
    assert isinstance(out, FakeTensor) and out.shape == (4, 16)


def test_a_hook_on_a_submodule_before_dispatch_is_refused_and_never_left_fake_tensors():
    """A feature extractor's hook, registered before compiling: it ran while tracing (keeping a
    fake tensor in the user's list) and then never again on a compiled call, with no warning."""
    from torch._subclasses.fake_tensor import FakeTensor

    torch.manual_seed(0)
    m = Scaled()
    ref = clone_module(m)
    mine, theirs = [], []
    m.fc.register_forward_hook(lambda mod, i, o: mine.append(o))
    ref.fc.register_forward_hook(lambda mod, i, o: theirs.append(o))
    x = torch.randn(4, 8)
    with pytest.raises(ConversionError, match=r"hooks on Scaled's submodules \(fc: 1 forward hook\).*fallback=True"):
        add_tvm_dispatch(m, (x,))
    assert mine == []  # the trace's fake tensor is not left behind
    add_tvm_dispatch(m, fallback=True)
    with pytest.warns(FallbackWarning, match="hooks on Scaled's submodules"):
        for _ in range(3):
            xi = torch.randn(4, 8)
            (m(xi).sum() + 0).backward()
            ref(xi).sum().backward()
    assert len(mine) == len(theirs) == 3
    for got, want in zip(mine, theirs):
        assert not isinstance(got, FakeTensor)
        torch.testing.assert_close(got, want)


def test_hooks_on_the_dispatched_module_itself_still_run_on_the_compiled_path():
    m = Block()
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    seen = []
    m.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    out = m(x.requires_grad_())
    assert is_tvm(out) and seen == [(4, 16)]


def test_nested_dispatch_parent_compiles_through_the_child():
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(16, 16), Block())
    ref = clone_module(parent)
    x = torch.randn(4, 16)
    add_tvm_dispatch(parent[1], (x,))
    add_tvm_dispatch(parent, (x,))
    got, want = run_step(parent, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0]) and max(relative_errors(got, want).values()) <= 1e-5


def test_dtype_change_after_dispatch_compiles_a_float64_variant():
    m = Block()
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    m.double()
    ref = clone_module(m)
    ref.remove_tvm_dispatch()
    got, want = run_step(m, (x.double(),)), run_step(ref, (x.double(),))
    assert got[0][0].dtype == torch.float64 and is_tvm(got[0][0])
    assert max(max_errors(got, want).values()) <= 1e-12
    assert "torch.float64, compiled for torch.float32" in m._tvm_dispatch.variants[-1].why
