"""The bridge against PyTorch autograd: outputs and every gradient, same seed."""
from __future__ import annotations

import warnings

import pytest
import torch

from tvmbridge import ConversionError, FallbackWarning, UnsupportedOpError, add_tvm_dispatch

from ..helpers import MLP, TwoOutputs, bert_inputs, bert_layer, clone_module, is_tvm, max_errors, run_step


@pytest.fixture(scope="module")
def bert32():
    torch.manual_seed(0)
    layer = bert_layer(torch.float32)
    ref = clone_module(layer)
    inputs = bert_inputs(torch.float32)
    add_tvm_dispatch(layer, inputs)
    return layer, ref, inputs


def test_bert_layer_float32_matches_pytorch(bert32):
    layer, ref, inputs = bert32
    got, want = run_step(layer, inputs), run_step(ref, inputs)
    assert is_tvm(got[0][0])
    errs = max_errors(got, want)
    assert len(errs) == 1 + 2 + 16  # output, both inputs, all 16 parameters
    assert max(errs.values()) <= 1e-4, errs


def test_dropout_is_active_and_matches_under_seed(bert32):
    layer, ref, inputs = bert32
    torch.manual_seed(5)
    train_out = layer(*inputs)
    assert is_tvm(train_out)
    ref.eval()
    try:
        eval_out = ref(*inputs)
    finally:
        ref.train()
    assert (train_out - eval_out).abs().max().item() > 1e-2  # dropout changed the result
    torch.manual_seed(5)
    again = layer(*inputs)
    assert torch.equal(train_out, again)  # same seed, same masks
    torch.manual_seed(6)
    assert not torch.equal(train_out, layer(*inputs))  # another seed, other masks


def test_other_shape_compiles_a_variant(bert32):
    layer, ref, _ = bert32
    x2, m2 = bert_inputs(torch.float32, batch=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        torch.manual_seed(1)
        a = layer(x2.requires_grad_(), m2)
    torch.manual_seed(1)
    b = ref(x2, m2)
    assert is_tvm(a) and (a - b).abs().max().item() <= 1e-4
    assert "hidden_states dim 0 is 2, compiled for 1" in layer._tvm_dispatch.variants[-1].why
    # keyword form of the first signature runs the first variant
    x, m = bert_inputs(torch.float32)
    assert is_tvm(layer(hidden_states=x.requires_grad_(), attention_mask=m))
    assert layer._tvm_dispatch.variants[0].calls >= 1 and layer._tvm_dispatch.calls_fallback == 0


def test_eval_mode_compiles_an_eval_variant(bert32):
    layer, ref, inputs = bert32
    layer.eval(); ref.eval()
    try:
        out = layer(*inputs)
        assert is_tvm(out)
        assert (out - ref(*inputs)).abs().max().item() <= 1e-4
        assert "BertLayer.training is False, compiled for True" in layer._tvm_dispatch.variants[-1].why
        again = layer(*inputs)
        assert torch.equal(out, again)  # no dropout in eval mode
    finally:
        layer.train(); ref.train()
    n = len(layer._tvm_dispatch.variants)
    assert is_tvm(layer(*inputs)) and len(layer._tvm_dispatch.variants) == n  # train variant reused


def test_remove_restores_original_forward():
    layer = bert_layer(small=True)
    before = layer.forward
    assert "forward" not in layer.__dict__
    add_tvm_dispatch(layer, bert_inputs(torch.float32, seq=5, hidden=64))
    assert "forward" in layer.__dict__
    layer.remove_tvm_dispatch()
    assert "forward" not in layer.__dict__ and layer.forward == before
    assert not hasattr(layer, "remove_tvm_dispatch")
    out = layer(*(t.requires_grad_(t.is_floating_point()) for t in bert_inputs(torch.float32, seq=5, hidden=64)))
    assert not is_tvm(out)


def test_bert_layer_float64_matches_pytorch():
    torch.manual_seed(0)
    layer = bert_layer(torch.float64)
    ref = clone_module(layer)
    inputs = bert_inputs(torch.float64)
    add_tvm_dispatch(layer, inputs)
    got, want = run_step(layer, inputs), run_step(ref, inputs)
    assert is_tvm(got[0][0])
    errs = max_errors(got, want)
    assert max(errs.values()) <= 1e-10, errs


@pytest.mark.parametrize("offload", ["auto", "torch", False], ids=["auto-gemm", "torch-gemm", "tvm-matmul"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_mlp_matches_pytorch(dtype, tol, offload):
    torch.manual_seed(0)
    m = MLP().train().to(dtype)
    ref = clone_module(m)
    x = torch.randn(4, 32, dtype=dtype)
    add_tvm_dispatch(m, (x,), offload_matmul=offload)
    fwd = m._tvm_dispatch.compiled.stages["fast_math"]["forward"].script()
    assert ("R.matmul" in fwd) != bool(offload)  # the option decides who runs the matmuls
    if offload:  # fc1's bias rides in addmm; under "auto" on the library measured fastest
        choices = m._tvm_dispatch.compiled.gemm_choices
        libraries = {c.library for c in choices} if offload == "auto" else {"torch"}
        assert choices and any(f"{lib}_addmm" in fwd for lib in libraries)
    assert ("_gelu_fast" in fwd) == (dtype == torch.float32)  # fast erf for float32 only
    got, want = run_step(m, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0])
    errs = max_errors(got, want)
    assert max(errs.values()) <= tol, errs


def test_exact_libm_math_matches_too():
    torch.manual_seed(0)
    m = MLP()
    ref = clone_module(m)
    x = torch.randn(4, 32)
    add_tvm_dispatch(m, (x,), fast_math=False)
    assert "_gelu_fast" not in m._tvm_dispatch.compiled.stages["fast_math"].script()
    errs = max_errors(run_step(m, (x,)), run_step(ref, (x,)))
    assert max(errs.values()) <= 1e-5, errs


def _kernels_run(module, args) -> set[str]:
    """Names of the functions the VM calls during one training step (its instrument hook)."""
    names: set[str] = set()

    def instrument(func, name, before, ret, *a):
        names.add(str(name))
        return 0

    module._tvm_dispatch.compiled.set_instrument(instrument)
    run_step(module, args)
    return names


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_fusion_switch_keeps_results(fuse):
    """``fuse=False`` (for measuring what fusion buys) runs one kernel per op and still matches."""
    torch.manual_seed(0)
    m = bert_layer(small=True)
    ref = clone_module(m)
    args = (torch.randn(2, 6, 64), torch.zeros(2, 1, 1, 6))
    add_tvm_dispatch(m, args, fuse=fuse)
    kernels = _kernels_run(m, args)
    assert any(k.startswith("fused_") for k in kernels) == fuse, sorted(kernels)
    errs = max_errors(run_step(m, args), run_step(ref, args))
    assert max(errs.values()) <= 1e-4, errs


def test_tuple_outputs_and_unused_output():
    torch.manual_seed(0)
    m = TwoOutputs()
    ref = clone_module(m)
    x = torch.randn(3, 16)
    add_tvm_dispatch(m, (x,), {"scale": 3.0})
    got, want = run_step(m, (x, 3.0)), run_step(ref, (x, 3.0))
    assert isinstance(m(x, scale=3.0), tuple)
    errs = max_errors(got, want)
    assert max(errs.values()) <= 1e-5, errs
    # another constant is another signature: a variant compiled for it
    other = m(x.requires_grad_(), scale=2.0)
    assert is_tvm(other[0]) and all((a - b).abs().max() <= 1e-5 for a, b in zip(other, ref(x, scale=2.0)))
    assert "scale is left at its default, compiled for scale=3.0" in m._tvm_dispatch.variants[-1].why
    # a loss on one output only: the other's gradient is zero, not an error
    xa = x.detach().clone().requires_grad_()
    xb = x.detach().clone().requires_grad_()
    m(xa, 3.0)[1].sum().backward()
    ref(xb, 3.0)[1].sum().backward()
    assert (xa.grad - xb.grad).abs().max().item() <= 1e-6
    assert (m.a.weight.grad is None or m.a.weight.grad.abs().max().item() == 0.0)


def test_frozen_parameter_and_input_without_grad():
    torch.manual_seed(0)
    m = MLP()
    m.fc1.weight.requires_grad_(False)
    ref = clone_module(m)
    x = torch.randn(4, 32)
    add_tvm_dispatch(m, (x,))
    torch.manual_seed(2); out = m(x)
    torch.manual_seed(2); exp = ref(x)
    assert is_tvm(out)
    out.sum().backward(); exp.sum().backward()
    assert m.fc1.weight.grad is None
    assert (m.fc2.weight.grad - ref.fc2.weight.grad).abs().max().item() <= 1e-5


def test_non_contiguous_and_unaligned_inputs():
    torch.manual_seed(0)
    m = MLP()
    ref = clone_module(m)
    add_tvm_dispatch(m, (torch.randn(4, 32),))
    base = torch.randn(33 * 4 + 1)
    unaligned = base[1:129].view(4, 32)  # storage offset of 4 bytes
    transposed = torch.randn(32, 4).t()  # non-contiguous
    for x in (unaligned, transposed):
        torch.manual_seed(3); a = m(x)
        torch.manual_seed(3); b = ref(x)
        assert is_tvm(a)
        assert (a - b).abs().max().item() <= 1e-5


def test_two_calls_before_one_backward_and_strided_output_grad():
    """Each call keeps its own captured values (a second call before the first's backward must not
    overwrite them); a non-contiguous output gradient reaches the backward correctly; an
    inference_mode call takes the TVM path and matches."""
    torch.manual_seed(0)
    m = bert_layer(small=True)
    ref = clone_module(m)
    x, mask = torch.randn(2, 6, 64), torch.zeros(2, 1, 1, 6)
    add_tvm_dispatch(m, (x, mask))
    grads, first = {}, {}
    for name, mod in (("tvm", m), ("torch", ref)):
        x1, x2 = x.clone().requires_grad_(), (2 * x).requires_grad_()
        torch.manual_seed(5)
        y1, y2 = mod(x1, mask), mod(x2, mask)
        g = torch.randn(64, 6, 2, generator=torch.Generator().manual_seed(1)).permute(2, 1, 0)
        assert not g.is_contiguous()
        torch.autograd.backward([y1, y2 ** 2], [g, torch.ones_like(y2)])
        grads[name] = [x1.grad, x2.grad] + [p.grad.clone() for p in mod.parameters()]
        first[name] = y1
    assert is_tvm(first["tvm"]) and not is_tvm(first["torch"])
    for a, b in zip(grads["tvm"], grads["torch"]):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())
    calls = m._tvm_dispatch.calls_tvm
    with torch.inference_mode():
        torch.manual_seed(3); a = m(x, mask)
        torch.manual_seed(3); b = ref(x, mask)
    assert m._tvm_dispatch.calls_tvm == calls + 1
    assert (a - b).abs().max().item() <= 1e-5


def test_sgd_loop_matches_pytorch_step_by_step():
    torch.manual_seed(0)
    layer = bert_layer(small=True)
    ref = clone_module(layer)
    x, mask = bert_inputs(torch.float32, batch=2, seq=6, hidden=64)
    target = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(9))
    add_tvm_dispatch(layer, (x, mask))
    opt_a = torch.optim.SGD(layer.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(ref.parameters(), lr=0.05)
    losses = []
    for step in range(20):
        pair = []
        for mod, opt in ((layer, opt_a), (ref, opt_b)):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            out = mod(x, mask)
            loss = torch.nn.functional.mse_loss(out, target)
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(pair)
    assert layer._tvm_dispatch.calls_tvm == 20
    rel = [abs(a - b) / abs(b) for a, b in losses]
    assert max(rel) <= 1e-4, losses
    assert losses[-1][0] < losses[0][0]  # it trained


# --- bad input ----------------------------------------------------------------------------------
class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum().item() > 0:  # on a float read: no trace keeps it, not even as the sample went
            return self.lin(x)
        return -self.lin(x)


class Unsupported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.special.i0(self.lin(x))  # no Relax converter


def test_untraceable_module_names_the_stage():
    m = DataDependent()
    with pytest.raises(ConversionError) as err:
        add_tvm_dispatch(m, (torch.randn(2, 4),))
    assert err.value.stage == "trace" and "DataDependent" in str(err.value)
    assert "forward" not in m.__dict__


def test_unsupported_op_names_the_op_and_fallback_warns():
    m = Unsupported()
    with pytest.raises(UnsupportedOpError) as err:
        add_tvm_dispatch(m, (torch.randn(2, 4),))
    assert err.value.stage == "convert" and "i0" in str(err.value)
    with pytest.warns(UserWarning, match="keeping PyTorch.*i0"):
        add_tvm_dispatch(m, (torch.randn(2, 4),), fallback=True)
    x = torch.randn(2, 4)
    assert torch.equal(m(x), torch.special.i0(m.lin(x)))


def test_wrong_device_is_rejected():
    m = MLP()
    with pytest.raises(ConversionError) as err:
        add_tvm_dispatch(m, (torch.randn(4, 32, device="meta"),))
    assert err.value.stage == "inputs" and "meta" in str(err.value)


def test_dispatch_twice_is_an_error():
    m = MLP()
    add_tvm_dispatch(m, (torch.randn(4, 32),))
    with pytest.raises(RuntimeError, match="already"):
        add_tvm_dispatch(m, (torch.randn(4, 32),))



def test_no_grad_call_runs_the_inference_function(bert32, monkeypatch):
    layer, ref, inputs = bert32

    def no_autograd(*a, **k):
        raise AssertionError("a no_grad call must not build the autograd Function")

    monkeypatch.setattr("tvmbridge.runtime.dispatch.TVMFunction.apply", no_autograd)
    before = layer._tvm_dispatch.calls_tvm
    with torch.no_grad():
        torch.manual_seed(11)
        got = layer(*inputs)
        torch.manual_seed(11)
        want = ref(*inputs)
    assert layer._tvm_dispatch.calls_tvm == before + 1 and got.grad_fn is None
    assert (got - want).abs().max().item() <= 1e-4
