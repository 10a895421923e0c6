"""TVM's CPU kernels round as eager's separate ops do: a multiply feeding an add is two roundings
in eager (two ATen ops) and was one in TVM's fused kernels, where LLVM contracted them into an FMA.
Off by default (``fp_contract=False``: the CPU target without its FMA feature); timm's RepVGG
amplified the one-ulp differences past noise in its BatchNorm gradients (README, zoo)."""

from __future__ import annotations

import copy

import pytest
import torch

from tvmbridge import add_tvm_dispatch, devices


class DropPathResidual(torch.nn.Module):
    """RepVGG's ``drop_path(branch) + identity`` in miniature: per-sample masks scale a product
    that an add then meets, the pattern LLVM contracts."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.v = torch.nn.Parameter(torch.randn(48)), torch.nn.Parameter(torch.randn(48))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape[0], 1) > 0.1).to(x.dtype) / 0.9
        return (x * self.w) * keep + x * self.v


def _step(m: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    out = m(x)
    out.backward(g)
    return [out.detach(), x.grad, *(p.grad for p in m.parameters())]


def test_products_feeding_adds_round_as_eager_bit_for_bit() -> None:
    torch.manual_seed(0)
    eager = DropPathResidual()
    tvm = copy.deepcopy(eager)
    x, g = torch.randn(48, 48), torch.randn(48, 48)
    add_tvm_dispatch(tvm, (x,), verify=False)
    got, want = _step(tvm, x, g), _step(eager, x, g)
    assert tvm._tvm_dispatch.calls_tvm == 1
    # elementwise results bit for bit; the parameters' gradients are sums over the batch, whose
    # order is TVM's own (a reduction's rounding, not a contraction's)
    for name, a, b in zip(["output", "grad:x"], got, want):
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} of {a.numel()} differ, up to {(a - b).abs().max():.3g}"
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("contract", [False, True])
def test_the_cpu_target_has_fma_only_where_contraction_is_asked_for(contract: bool) -> None:
    target = devices.target_for(torch.device("cpu"), fp_contract=contract)
    assert ("-fma" in list(target.attrs.get("mattr", []))) is not contract


def _barriers(mod) -> int:
    from tvm import relax

    from tvmbridge.kernels.barrier import BARRIER

    return sum(
        1
        for func in mod.functions.values()
        if isinstance(func, relax.Function)
        for block in func.body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call)
        and b.value.op.name == "relax.call_pure_packed"
        and str(b.value.args[0].global_symbol) == BARRIER
    )


@pytest.mark.parametrize("contract", [False, True])
def test_batchnorm_running_averages_are_eager_s_bit_for_bit(contract: bool) -> None:
    """BatchNorm's new running statistics (``(1 - m) * old + m * batch``) equal eager's to the bit
    over several steps: on a target that contracts, through the barriers that keep each product
    rounded; on one that cannot (the default), with the barriers taken out before fusion. The
    BatchNorm reads the input itself: a convolution in front made the test depend on TVM's and
    oneDNN's convolutions agreeing to the bit, which they do on an AVX-512 CPU and not on an AVX2
    one (one ulp), where the statistics then differ for a reason this test is not about."""
    from tvmbridge.backend import build
    from tvmbridge.pipeline.parts import TRAIN, part_module
    from tvmbridge.runtime.dispatch import dispatcher_of

    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=0.3), torch.nn.ReLU())
    tvm_model = copy.deepcopy(eager)
    x = torch.randn(4, 3, 9, 9)
    add_tvm_dispatch(tvm_model, (x,), verify=False, fp_contract=contract)
    for step in range(4):
        xs = torch.randn(4, 3, 9, 9) * (step + 1)
        tvm_model(xs).sum().backward()
        eager(xs).sum().backward()
    assert tvm_model._tvm_dispatch.calls_tvm == 4
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(tvm_model[0], name), getattr(eager[0], name)), name
    compiled = dispatcher_of(tvm_model).variants[0].compiled
    part = part_module(compiled.stages["fast_math"], TRAIN)
    assert _barriers(part) == 2
    target = devices.target_for(torch.device("cpu"), fp_contract=contract)
    assert _barriers(build.lower(part, target)) == (2 if contract else 0)
