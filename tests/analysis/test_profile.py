"""symbolic_trace / symbolic_profile / MetaTensorMode against real PyTorch runs."""
from __future__ import annotations

import gc
import logging
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import analysis
from analysis import (MetaTensorMode, MetaTraceError, measure_saved_bytes, register_shape_impl,
                      symbolic_profile, symbolic_trace)
from analysis.profiling.flops import FlopCounter, is_torch_counted
from analysis.models import MODELS

from ..helpers import SMALL_SIZES as SMALL

logging.getLogger("transformers").setLevel(logging.ERROR)
aten = torch.ops.aten


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _real_run(model: torch.nn.Module, x: torch.Tensor) -> tuple[dict, int, FlopCounter]:
    """Forward+backward for real: PyTorch's counts, saved-for-backward bytes, our eager counts."""
    state = list(model.parameters()) + list(model.buffers())
    with FlopCounterMode(display=False) as ref:
        out, saved = measure_saved_bytes(model, x, exclude=state)
        _first(out).backward(torch.ones_like(_first(out)))
    model.zero_grad(set_to_none=True)  # else the second backward adds into .grad
    with FlopCounter() as fc:
        out = _first(model(x))
        out.backward(torch.ones_like(out))
    return ref.get_flop_counts()["Global"], saved, fc


def _profile(name: str, input_grad: bool = False, **kw):
    torch.manual_seed(0)
    model, margs = MODELS[name](**{**SMALL[name], **kw})
    x = next(iter(margs.values())).requires_grad_(input_grad)
    gm = symbolic_profile(symbolic_trace(model, margs), x)
    return model, x, gm


@pytest.mark.parametrize("name", ["cnn", "bert", "gpt2"])
def test_profile_flops_and_memory_match_real_run(name: str) -> None:
    model, x, gm = _profile(name)
    ref, saved, eager = _real_run(model, x)
    s = gm.meta["profile"]
    total = {k: s.fwd_flops_by_op.get(k, 0) + s.bwd_flops_by_op.get(k, 0)
             for k in set(s.fwd_flops_by_op) | set(s.bwd_flops_by_op)}
    expected = {k: v for k, v in ref.items() if v}
    assert expected
    assert {k: v for k, v in total.items() if is_torch_counted(k) and v} == expected
    # all ops, our formulas included: the per-node profile equals an eager count of the real run
    assert s.fwd_flops == eager.total("forward")
    assert s.bwd_flops == eager.total("backward"), (s.bwd_flops_by_op, eager.by_op(phase="backward"))
    # memory fidelity (the issue asks for 5%)
    assert saved > 0
    assert abs(s.backward_bytes - saved) <= 0.05 * saved, (s.backward_bytes, saved)
    assert s.peak_activation_bytes >= s.backward_bytes


@pytest.mark.parametrize("input_grad, factor", [(False, 1), (True, 2)])
def test_first_conv_backward_in_profile(input_grad: bool, factor: int) -> None:
    _, _, gm = _profile("cnn", input_grad)
    conv1 = next(n for n in gm.graph.nodes if n.target == "conv1")
    p = conv1.meta["profile"]
    assert p.fwd_flops_by_op[aten.convolution] > 0
    assert p.bwd_flops_by_op[aten.convolution_backward] == factor * p.fwd_flops_by_op[aten.convolution]


def test_frozen_weights_in_profile() -> None:
    torch.manual_seed(0)
    model, margs = MODELS["bert"](**SMALL["bert"])
    for p in model.attention.parameters():
        p.requires_grad_(False)
    x = margs["hidden_states"]
    gm = symbolic_profile(symbolic_trace(model, margs), x)
    ref, saved, eager = _real_run(model, x)
    s = gm.meta["profile"]
    assert {k: v for k, v in s.bwd_flops_by_op.items() if is_torch_counted(k) and v} == \
        {k: v for k, v in eager.by_op(phase="backward").items() if is_torch_counted(k) and v}
    assert abs(s.backward_bytes - saved) <= 0.05 * saved


class DimBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.mean(dim=1)
        b, n = x.shape
        return self.proj(x).view(b, -1) * len(x.shape)


@pytest.mark.parametrize("shape", [(4, 5, 8), (4, 8)])
def test_shape_dependent_control_flow(shape: tuple[int, ...]) -> None:
    gm = symbolic_trace(DimBranch(), meta_args={"x": torch.empty(*shape, device="meta")})
    has_mean = any(n.target == "mean" for n in gm.graph.nodes)
    assert has_mean == (len(shape) == 3)
    symbolic_profile(gm, torch.empty(*shape, device="meta"))
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert tuple(out.meta["val"].shape) == (4, 8)
    # the traced graph computes what the module computes
    m = DimBranch()
    gm2 = symbolic_trace(m, meta_args={"x": torch.empty(*shape)})
    x = torch.randn(*shape)
    torch.testing.assert_close(gm2(x), m(x))


class KwAndTuple(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0):
        h = self.lin(x) * scale
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return h, h.sum(-1)


def test_keyword_inputs_and_tuple_outputs() -> None:
    x, mask = torch.randn(2, 8), torch.rand(2, 8) > 0.5
    m = KwAndTuple()
    gm = symbolic_trace(m, meta_args={"x": x, "mask": mask}, concrete_args={"scale": 2.0})
    torch.testing.assert_close(gm(x, mask), m(x, mask, 2.0))
    assert any(n.target == "masked_fill" for n in gm.graph.nodes)
    gm_nomask = symbolic_trace(m, meta_args={"x": x})  # mask takes its default: the None branch
    assert not any(n.target == "masked_fill" for n in gm_nomask.graph.nodes)
    symbolic_profile(gm, x, mask)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert [tuple(t.shape) for t in (a.meta["val"] for a in out.args[0])] == [(2, 8), (2,)]
    with pytest.raises(ValueError, match="needs a value"):
        symbolic_trace(torch.nn.Bilinear(2, 2, 2), meta_args={"input1": x})


def host_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Data-dependent Python that cannot run on fake tensors."""
    keep = sorted(range(x.shape[-1]), key=lambda i: -float(x[0, i]))[:k]
    return x[:, keep]


class UsesHostCode(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return host_topk(x, 3) * 2


def test_register_shape_impl() -> None:
    with pytest.raises(MetaTraceError):
        symbolic_trace(UsesHostCode(), meta_args={"x": torch.empty(4, 10, device="meta")})
    register_shape_impl(host_topk, lambda x, k: x.new_empty(x.shape[0], k))
    gm = symbolic_trace(UsesHostCode(), meta_args={"x": torch.empty(4, 10, device="meta")})
    leaf = [n for n in gm.graph.nodes if n.target is host_topk]
    assert len(leaf) == 1 and tuple(leaf[0].meta["val"].shape) == (4, 3)
    x = torch.randn(4, 10)
    torch.testing.assert_close(gm(x), UsesHostCode()(x))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_meta_mode_allocates_no_real_memory() -> None:
    gc.collect()
    # the measurement can see a real allocation of this size...
    base = _rss()
    real = torch.ones(64, 1024, 1024)  # 256 MiB, touched
    assert _rss() - base > 200 * 2**20
    del real
    gc.collect()
    # ...and sees none when 2 GiB of weights and their activations exist only as fake tensors
    base = _rss()
    with MetaTensorMode():
        model = torch.nn.Sequential(*[torch.nn.Linear(8192, 8192) for _ in range(8)])
        x = torch.randn(512, 8192)
    assert all(isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())
    gm = symbolic_profile(symbolic_trace(model, {"input": x}), x)
    s = gm.meta["profile"]
    assert s.param_bytes >= 2 * 2**30 and s.fwd_flops == 8 * 2 * 512 * 8192 * 8192  # addmm
    assert _rss() - base < 100 * 2**20


def test_verbose_table_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    _, margs = MODELS["cnn"](**SMALL["cnn"])
    model = MODELS["cnn"](**SMALL["cnn"])[0]
    symbolic_profile(symbolic_trace(model, margs), *margs.values(), verbose=True)
    out = capsys.readouterr().out
    for col in ("output", "temp", "param", "backward", "accumulated", "incremental", "fwd FLOPs", "bwd FLOPs"):
        assert col in out
    assert "KiB" in out and "MFLOP" in out and out.strip().splitlines()[-1].startswith("total: forward")
    from analysis.__main__ import main

    assert main(["profile", "cnn", "--batch", "2", "--size", "16"]) == 0
    assert "peak activation memory" in capsys.readouterr().out


def test_public_names() -> None:
    for name in ("MetaTensorMode", "symbolic_trace", "symbolic_profile", "FlopCounter",
                 "register_shape_impl"):
        assert getattr(analysis, name) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn", "bert", "gpt2"])
def test_default_size_models_match_real_run(name: str) -> None:
    model, x, gm = _profile(name, **({"batch": 8} if name == "cnn" else {"batch": 8, "seq": 128, "hidden": 768, "heads": 12}))
    ref, saved, _ = _real_run(model, x)
    s = gm.meta["profile"]
    total = {k: s.fwd_flops_by_op.get(k, 0) + s.bwd_flops_by_op.get(k, 0) for k in ref}
    assert total == ref
    assert abs(s.backward_bytes - saved) <= 0.05 * saved


def test_profile_gpt2_model_with_kwargs_placeholder() -> None:
    """GPT2Model's forward takes ``**kwargs`` and pops from it: the placeholder's dict must
    reach the node as itself, not as fx's immutable copy."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = GPT2Model(cfg).train()
    ids = torch.randint(0, 100, (2, 8))
    gm = symbolic_profile(symbolic_trace(model, {"input_ids": ids}), ids)
    assert any(n.op == "call_method" and n.target == "pop" for n in gm.graph.nodes)
    with FlopCounterMode(display=False) as ref:
        model(ids).last_hidden_state.sum().backward()
    s = gm.meta["profile"]
    total = {k: s.fwd_flops_by_op.get(k, 0) + s.bwd_flops_by_op.get(k, 0)
             for k in set(s.fwd_flops_by_op) | set(s.bwd_flops_by_op)}
    expected = {k: v for k, v in ref.get_flop_counts()["Global"].items() if v}
    assert expected and {k: v for k, v in total.items() if is_torch_counted(k) and v} == expected
