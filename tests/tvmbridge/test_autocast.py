"""Mixed precision: calls under ``torch.autocast`` run a variant traced under that autocast.

The tolerance, and why: under autocast both PyTorch and TVM round every op's result to
bfloat16/float16, in different places (TVM fuses ops, sums in another order), so they do not
agree bit for bit, and neither is "the" answer. What must hold is that TVM is as accurate as
eager autocast: against the exact value (a float64 copy of the module on the same inputs and
output gradient), TVM's error may be at most 3x eager autocast's own, plus 4 unit roundoffs of
the low dtype, per output and per gradient (relative to the tensor's largest exact magnitude,
floored at 1e-3 of the largest gradient: a gradient that is 0 exactly holds rounding residue
only). A wrong mask, a missing cast to float32 or a lost term gives errors far above that.
"""
from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tvmbridge import FallbackWarning, add_tvm_dispatch, compile_inference
from tvmbridge.errors import VerificationWarning

from ..helpers import is_tvm

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


class Block(nn.Module):
    """Linear, GELU, LayerNorm (mixed-type under autocast), dropout, Linear, softmax."""

    def __init__(self, d: int = 16, p: float = 0.0) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.norm = nn.LayerNorm(2 * d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.fc2(self.drop(self.norm(F.gelu(self.fc1(x))))).softmax(-1)


def step(module: nn.Module, args: tuple, low: torch.dtype | None, exact: bool = False):
    """One forward and backward under autocast to ``low`` (None: off), fixed seeds; the output
    gradient is drawn in float32 and rounded to ``low``, so every run gets the same values.
    ``exact``: run a float64 copy without autocast. Returns (outputs, grads by name)."""
    if exact:
        module = copy.deepcopy(module).double()
        args = tuple(a.double() if a.is_floating_point() else a for a in args)
    args = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) for a in args)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None and not exact):
        out = module(*args)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    grads_out = [torch.randn(o.shape, generator=gen) for o in outs]
    if low is not None:
        grads_out = [g.to(low) for g in grads_out]
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads_out, outs)])
    grads = {f"input{i}": a.grad for i, a in enumerate(args) if a.grad is not None}
    grads.update({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    for p in module.parameters():
        p.grad = None
    return outs, grads


def assert_as_accurate_as_eager(got, eager, exact, low: torch.dtype) -> None:
    """The module docstring's rule, for every output and gradient."""
    (o_got, g_got), (o_eager, g_eager), (o_exact, g_exact) = got, eager, exact
    for a, b in zip(o_got, o_eager):
        assert a.dtype == b.dtype, "outputs follow autocast's dtypes"
    named = {**{f"out{i}": t for i, t in enumerate(o_exact)}, **g_exact}
    ours = {**{f"out{i}": t for i, t in enumerate(o_got)}, **g_got}
    theirs = {**{f"out{i}": t for i, t in enumerate(o_eager)}, **g_eager}
    assert ours.keys() == theirs.keys() == named.keys()
    largest = max(g.abs().max().item() for g in g_exact.values())
    bad = {}
    for k, ref in named.items():
        assert ours[k].dtype == theirs[k].dtype, k
        scale = max(ref.abs().max().item(), 1e-3 * largest)
        e_ours = (ours[k].double() - ref).abs().max().item() / scale
        e_eager = (theirs[k].double() - ref).abs().max().item() / scale
        if e_ours > 3 * e_eager + 4 * UNIT_ROUNDOFF[low]:
            bad[k] = (e_ours, e_eager)
    assert not bad, f"TVM error vs eager autocast's, relative to the exact value: {bad}"


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_block_under_autocast_as_accurate_as_eager(low):
    torch.manual_seed(0)
    m = Block()
    ref = copy.deepcopy(m)
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=low), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        add_tvm_dispatch(m, (x,))
    got = step(m, (x,), low)
    assert is_tvm(got[0][0]), m._tvm_dispatch.explain()
    assert got[0][0].dtype == low
    assert all(g.dtype == torch.float32 for g in got[1].values()), "gradients in the parameters' dtype"
    assert_as_accurate_as_eager(got, step(ref, (x,), low), step(ref, (x,), low, exact=True), low)


def test_dropout_masks_under_autocast_are_pytorchs():
    """Train-mode dropout on bfloat16 activations: the masks are PyTorch's, so TVM and eager
    autocast agree to bfloat16 rounding (a different mask would differ by O(1))."""
    torch.manual_seed(0)
    m = Block(p=0.3)
    ref = copy.deepcopy(m)
    x = torch.randn(8, 16)
    add_tvm_dispatch(m, (x,))
    got, want = step(m, (x,), torch.bfloat16), step(ref, (x,), torch.bfloat16)
    assert is_tvm(got[0][0])
    for k in want[1]:
        scale = want[1][k].abs().max().item()
        assert (got[1][k] - want[1][k]).abs().max().item() <= 0.05 * scale, k
    assert (got[0][0].float() - want[0][0].float()).abs().max().item() <= 0.02


def test_autocast_on_and_off_get_their_own_variants():
    torch.manual_seed(0)
    m = Block()
    ref = copy.deepcopy(m)
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        for low in (None, torch.bfloat16, None, torch.float16, torch.bfloat16):
            with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
                out, want = m(x), ref(x)
            assert is_tvm(out) and out.dtype == want.dtype
            tol = 1e-5 if low is None else 4 * UNIT_ROUNDOFF[low]
            assert (out.float() - want.float()).abs().max().item() <= tol
    d = m._tvm_dispatch
    labels = [v.label for v in d.variants]
    assert len(labels) == 3, d.explain()
    assert sum("autocast(cpu, bfloat16)" in s for s in labels) == 1
    assert sum("autocast(cpu, float16)" in s for s in labels) == 1


def test_autocast_disabled_inside_forward_is_traced():
    """A forward that leaves autocast for part of its work (a float32 loss, say) keeps that part
    in float32, as eager does."""

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            h = self.fc(x)
            with torch.autocast("cpu", enabled=False):
                return self.head(h.to(self.head.weight.dtype)).log_softmax(-1)

    torch.manual_seed(0)
    m = Mixed()
    ref = copy.deepcopy(m)
    x = torch.randn(4, 16)
    got = step(add_tvm_dispatch(m), (x,), torch.bfloat16)
    assert is_tvm(got[0][0]) and got[0][0].dtype == torch.float32
    assert_as_accurate_as_eager(got, step(ref, (x,), torch.bfloat16), step(ref, (x,), None, exact=True),
                                torch.bfloat16)


def test_threads_with_and_without_autocast():
    """Autocast is per thread: each thread's calls run the variant of its own state."""
    torch.manual_seed(0)
    m = Block()
    ref = copy.deepcopy(m)
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = {False: ref(x)}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want[True] = ref(x)
    add_tvm_dispatch(m)
    errors: list[str] = []

    def work(on: bool) -> None:
        for _ in range(30):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on), torch.no_grad():
                out = m(x)
            if out.dtype != want[on].dtype or (out.float() - want[on].float()).abs().max().item() > 0.02:
                errors.append(f"autocast {on}: {out.dtype} vs {want[on].dtype}")

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert m._tvm_dispatch.calls_fallback == 0 and len(m._tvm_dispatch.variants) == 2


def test_double_backward_under_autocast():
    """``create_graph=True`` reruns PyTorch's forward for the second derivative: under the
    variant's autocast, even when the backward is called after the autocast region."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = copy.deepcopy(m)
    x = torch.randn(4, 8)
    add_tvm_dispatch(m)

    def penalty(module):
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(xx)
        (g,) = torch.autograd.grad(y.float().sum(), xx, create_graph=True)
        g.square().sum().backward()
        return y, [p.grad for p in module.parameters()]

    y, got = penalty(m)
    y_ref, want = penalty(ref)
    assert is_tvm(y) and y.dtype == torch.bfloat16
    assert [a is None for a in got] == [b is None for b in want] == [False, False, False, True]
    for a, b in zip(got[:3], want[:3]):
        assert (a - b).abs().max().item() <= 0.02 * b.abs().max().item() + 1e-6


def test_grad_scaler_float16_training_follows_eager():
    torch.manual_seed(0)
    m = Block()
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m)
    xs = [torch.randn(8, 16) for _ in range(5)]
    targets = [torch.randint(0, 16, (8,)) for _ in range(5)]
    losses = {}
    for name, model in (("tvm", m), ("eager", ref)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        losses[name] = []
        for x, t in zip(xs, targets):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                loss = F.nll_loss(out.float().log(), t)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses[name].append(loss.item())
        losses[name + " scale"] = scaler.get_scale()
    assert is_tvm(m(xs[0]))
    assert losses["tvm scale"] == losses["eager scale"]
    for a, b in zip(losses["tvm"], losses["eager"]):
        assert abs(a - b) <= 4e-3 * abs(b), losses
    for p, q in zip(m.parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 5e-3


def test_bfloat16_module_without_autocast():
    """A module cast to bfloat16 as a whole (no autocast): bfloat16 parameters and gradients."""
    torch.manual_seed(0)
    m = Block().to(torch.bfloat16)
    ref = copy.deepcopy(m)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    add_tvm_dispatch(m, (x,))
    got = step(m, (x,), None)
    assert is_tvm(got[0][0]) and got[0][0].dtype == torch.bfloat16
    assert all(g.dtype == torch.bfloat16 for g in got[1].values())
    want, exact = step(ref, (x,), None), step(ref, (x,), None, exact=True)
    assert_as_accurate_as_eager(got, want, exact, torch.bfloat16)


def test_bfloat16_top_k_values_stay_bfloat16():
    """``x.max(dim)`` of a bfloat16 tensor (a top-1: values and indices) computed in float32 gives
    bfloat16 values, as PyTorch's: the values came out float32 (the first-call check discarded
    the variant), and added to another bfloat16 value the compile failed."""

    class Extremes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones((), dtype=torch.bfloat16))

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return (t * self.w).max(-1, keepdim=True).values + (t * self.w).amin(0)

    m = Extremes()
    t = torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=True)
    want = m(t)
    add_tvm_dispatch(m, (t,))
    got = m(t)
    assert is_tvm(got) and got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_inference_compiled_under_autocast():
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inf = compile_inference(m, (x,))
        out, want = inf(x), m(x)
    assert out.dtype == want.dtype == torch.bfloat16
    assert (out.float() - want.float()).abs().max().item() <= 0.02
    with pytest.raises(ValueError, match="without autocast"):
        inf(x)


@pytest.mark.parametrize("name,train", [("bert-mlm", False), ("resnet-cls", True)], ids=["bert-mlm", "resnet-train"])
def test_whole_model_under_autocast(name, train):
    """Embeddings, attention, cross-entropy (BERT); convolutions and train-mode BatchNorm, its
    running statistics included (ResNet): loss and every gradient as accurate as eager's."""
    from tvmbridge.tools.whole_models import build_task

    task = build_task(name, "small", 2, 16)
    task.model.train(train)
    ref, exact = copy.deepcopy(task.model), copy.deepcopy(task.model).double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        add_tvm_dispatch(task.model, task.args, task.kwargs)

    def run(model, cast, autocast):
        args = tuple(a.double() if cast and a.is_floating_point() else a for a in task.args)
        kwargs = {k: v.double() if cast and v.is_floating_point() else v for k, v in task.kwargs.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(*args, **kwargs)
        out.loss.backward()
        return (out.loss.reshape(1),), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    with warnings.catch_warnings():
        # the first-call check keeps the variant: bfloat16 gradients as far from float32's as
        # eager's own are (ResNet's convolution weights: ~20% of their size) are not a mismatch
        warnings.simplefilter("error", VerificationWarning)
        got = run(task.model, False, True)
    assert task.model._tvm_dispatch.calls_tvm == 1 and not task.model._tvm_dispatch.discarded
    assert_as_accurate_as_eager(got, run(ref, False, True), run(exact, True, False), torch.bfloat16)
    for (n, b), b_ref in zip(task.model.named_buffers(), ref.buffers()):
        if b.is_floating_point():
            assert (b - b_ref).abs().max().item() <= 0.02 * max(b_ref.abs().max().item(), 1.0), n


def test_tvm_own_matmuls_under_autocast_accumulate_in_float32():
    """With the GEMMs left to TVM (offload_matmul=False), bfloat16 matmuls accumulate in float32
    as the libraries do: a bfloat16 accumulator over k=256 would be far off."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 8))
    ref = copy.deepcopy(m)
    x = torch.randn(16, 256)
    add_tvm_dispatch(m, offload_matmul=False)
    got = step(m, (x,), torch.bfloat16)
    assert is_tvm(got[0][0])
    # the last stage's module (a compile loaded from the disk cache keeps it too)
    assert "R.matmul" in m._tvm_dispatch.compiled.stages["fast_math"]["forward"].script()
    assert_as_accurate_as_eager(got, step(ref, (x,), torch.bfloat16), step(ref, (x,), None, exact=True),
                                torch.bfloat16)


def test_symbolic_variant_under_autocast_serves_every_batch():
    """A training loop under autocast whose batch size varies: the second size compiles one
    symbolic autocast variant, which serves the sizes after it."""
    torch.manual_seed(0)
    m = Block()
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m)
    for n in (4, 6, 9, 13):
        x = torch.randn(n, 5, 16)
        got, want = step(m, (x,), torch.bfloat16), step(ref, (x,), torch.bfloat16)
        assert is_tvm(got[0][0]) and got[0][0].dtype == torch.bfloat16
        for k in want[1]:
            assert (got[1][k] - want[1][k]).abs().max().item() <= 0.03 * want[1][k].abs().max().item() + 1e-6, k
    d = m._tvm_dispatch
    assert len(d.variants) == 2 and d.variants[1].symbolic and d.variants[1].calls == 3, d.explain()


def test_a_bfloat16_gelu_backward_is_one_kernel():
    """Float32Opmath reads an op's float32 result where the next op wants it and leaves its
    bfloat16 rounding unread; left in the module, that dead rounding was a second consumer to
    FuseOps, so GELU's erf, exp and adds each wrote their result out as a kernel of its own."""
    import tvm

    from tvmbridge import devices
    from tvmbridge.backend import build

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        add_tvm_dispatch(m, (x,))
    lowered = build.lower(m._tvm_dispatch.compiled.stages["fast_math"], devices.target_for(torch.device("cpu")))
    kernels = [gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    alone = [k for k in kernels if k.startswith(("fast_erf", "fast_exp", "erf", "exp"))]
    assert not alone, kernels
