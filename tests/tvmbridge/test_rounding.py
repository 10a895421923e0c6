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
