"""Compile by submodules (``runtime/submodules.py``): under ``fallback=True`` a module that cannot
compile as a whole keeps PyTorch for its own code only, and its submodules with parameters compile
by themselves; training through them gives PyTorch's outputs and gradients."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from tests.helpers import is_tvm
from tvmbridge import add_tvm_dispatch
from tvmbridge.errors import ConversionError, FallbackWarning


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(nn.functional.gelu(self.fc1(x))))


class LayerDrop(nn.Module):
    """transformers' LayerDrop (wav2vec2, HuBERT, ...): in training each layer is skipped when a
    uniform draw falls below ``layerdrop``, a Python branch on a random value no trace can keep."""

    def __init__(self, layers: int = 3, layerdrop: float = 0.3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Block() for _ in range(layers)])
        self.head = nn.Linear(8, 2)
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            h = layer(h)
        return self.head(h)


class Spectral(nn.Module):
    """FNet's token mixing: an FFT (no converter) in a submodule without parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft2(x).real


class SpectralNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.block, self.head = nn.Linear(4, 8), Spectral(), Block(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.mix(self.embed(x))))


def _train_side_by_side(make, steps: int = 4, **options):
    """The model dispatched and a copy in PyTorch, trained with AdamW on the same draws: the
    dispatched model, and the largest output and gradient differences over the steps."""
    torch.manual_seed(0)
    model = make().train()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 5, 4)
    with pytest.warns(FallbackWarning, match="own code.*submodules run on TVM by themselves"):
        add_tvm_dispatch(model, (x,), fallback=True, **options)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    worst_out = worst_grad = 0.0
    for step in range(steps):
        outs = []
        for m, opt in zip((model, ref), opts):
            torch.manual_seed(100 + step)  # the same layers dropped in both
            opt.zero_grad()
            out = m(x * (1 + step))
            (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            outs.append(out)
        worst_out = max(worst_out, (outs[0] - outs[1]).abs().max().item())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                worst_grad = max(worst_grad, (p.grad - q.grad).abs().max().item())
    return model, worst_out, worst_grad


def test_a_layerdrop_model_trains_its_layers_on_tvm_with_pytorchs_numbers() -> None:
    model, worst_out, worst_grad = _train_side_by_side(LayerDrop)
    assert worst_out < 1e-5 and worst_grad < 1e-5
    parent = model._tvm_dispatch
    assert parent.variant_set.submodules == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert parent.calls_tvm == 0 and parent.calls_fallback == 4
    assert all(m._tvm_dispatch.calls_tvm >= 1 and len(m._tvm_dispatch.variants) == 1 for m in model.layers)
    assert "submodule layers.0: 1 variant(s)" in parent.explain()
    assert is_tvm(model.layers[0](torch.randn(2, 8)))
    assert model._tvm_dispatch.submodule_of is None and model.layers[0]._tvm_dispatch.submodule_of == "LayerDrop"


def test_eval_mode_still_compiles_the_whole_module() -> None:
    """The branch is taken in training only: eval calls compile the module as a whole (its
    dispatched submodules traced through as PyTorch code), and run it on TVM."""
    model, _, _ = _train_side_by_side(LayerDrop, steps=1)
    model.eval()
    x = torch.randn(3, 5, 4)
    with torch.no_grad():
        got = model(x)
        ref = model._tvm_dispatch.eager(x)
    assert model._tvm_dispatch.calls_tvm == 1 and len(model._tvm_dispatch.variants) == 1
    torch.testing.assert_close(got, ref)


def test_a_variant_compiled_before_its_submodules_were_dispatched_still_fits() -> None:
    """Dispatching the submodules sets their ``forward``: the state guard knows it for a dispatch
    (the same forward runs), so the eval variant compiled first is not compiled again."""
    torch.manual_seed(0)
    model = LayerDrop().eval()
    x = torch.randn(3, 5, 4)
    add_tvm_dispatch(model, (x,), fallback=True)
    model.train()
    with pytest.warns(FallbackWarning, match="submodules run on TVM"):
        model(x).sum().backward()
    model.eval()
    with torch.no_grad():
        model(x)
    assert len(model._tvm_dispatch.variants) == 1 and model._tvm_dispatch.calls_tvm == 1


def test_an_op_without_converter_in_a_submodule_without_parameters() -> None:
    model, worst_out, worst_grad = _train_side_by_side(SpectralNet)
    assert worst_out < 1e-5 and worst_grad < 1e-5
    assert model._tvm_dispatch.variant_set.submodules == ["embed", "block", "head"]  # mix has nothing to learn
    assert getattr(model.mix, "_tvm_dispatch", None) is None


def test_a_failing_submodule_is_split_in_turn() -> None:
    """The failure sits one level down: the outer module's submodule fails too, and its own
    submodules compile by themselves."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.head = LayerDrop(), nn.Linear(2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(x))

    torch.manual_seed(0)
    model = Outer().train()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 5, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        add_tvm_dispatch(model, (x,), fallback=True)
        torch.manual_seed(1)
        got = model(x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, ref(x))
    assert model._tvm_dispatch.variant_set.submodules == ["encoder", "head"]
    assert model.encoder._tvm_dispatch.variant_set.submodules[1:4] == ["layers.0", "layers.1", "layers.2"]
    said = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert any("Outer's own code" in s for s in said) and any("layers.0" in s for s in said)
    model.remove_tvm_dispatch()  # every submodule's dispatch goes with it
    assert all(getattr(m, "_tvm_dispatch", None) is None for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_failure_at_the_first_call_dispatches_submodules_too() -> None:
    torch.manual_seed(0)
    model = LayerDrop().train()
    ref = copy.deepcopy(model)
    add_tvm_dispatch(model, fallback=True)
    x = torch.randn(3, 5, 4)
    with pytest.warns(FallbackWarning, match="fell back to PyTorch for LayerDrop.*submodules run on TVM.*layers.0"):
        torch.manual_seed(3)
        got = model(x)
    torch.manual_seed(3)
    torch.testing.assert_close(got, ref(x))
    assert model.layers[1]._tvm_dispatch.submodule_of == "LayerDrop"


def test_a_submodule_the_user_dispatched_stays_theirs() -> None:
    torch.manual_seed(0)
    model = LayerDrop().train()
    add_tvm_dispatch(model.head)
    mine = model.head._tvm_dispatch
    with pytest.warns(FallbackWarning, match="own code"):
        add_tvm_dispatch(model, (torch.randn(3, 5, 4),), fallback=True)
    assert model.head._tvm_dispatch is mine and "head" not in model._tvm_dispatch.variant_set.submodules
    model.remove_tvm_dispatch()
    assert model.head._tvm_dispatch is mine and getattr(model.embed, "_tvm_dispatch", None) is None


def test_compile_submodules_off_keeps_pytorch_for_all_of_it() -> None:
    torch.manual_seed(0)
    model = LayerDrop().train()
    with pytest.warns(FallbackWarning, match=r"keeping PyTorch for LayerDrop: \[trace\]"):
        add_tvm_dispatch(model, (torch.randn(3, 5, 4),), fallback=True, compile_submodules=False)
    assert all(getattr(m, "_tvm_dispatch", None) is None for m in model.modules())


def test_without_fallback_the_failure_raises_and_nothing_is_dispatched() -> None:
    model = LayerDrop().train()
    with pytest.raises(ConversionError, match="branches on a tensor's values.*fallback=True.*submodules") as raised:
        add_tvm_dispatch(model, (torch.randn(3, 5, 4),))
    # the line that branches, and what this one is
    assert re.search(r"test_submodule_fallback.py:\d+: `if self.training and torch.rand\(\[\]\) < self.layerdrop:`", str(raised.value))
    assert "LayerDrop" in str(raised.value) and "layerdrop=0.0" in str(raised.value)
    assert all(getattr(m, "_tvm_dispatch", None) is None for m in model.modules())


def test_a_failure_of_the_module_code_is_not_traced_again_at_each_new_size() -> None:
    """Audio lengths change every batch: a trace that failed on the module's code (here its
    LayerDrop branch) would fail at any size, and tracing again at each one costs seconds."""
    torch.manual_seed(0)
    model = LayerDrop().train()
    ref = copy.deepcopy(model)
    add_tvm_dispatch(model, fallback=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        for step, length in enumerate((5, 7, 9, 11)):
            x = torch.randn(2, length, 4)
            torch.manual_seed(step)
            got = model(x)
            torch.manual_seed(step)
            torch.testing.assert_close(got, ref(x))
    parent = model._tvm_dispatch
    assert len(parent.failures) == 1 and parent.calls_fallback == 4 and list(parent.fallback_reasons.values()) == [4]
    assert model.embed._tvm_dispatch.calls_tvm == 4  # its own variants: one exact, then one symbolic


def test_a_submodule_with_hooks_compiles_by_itself_with_its_hooks_around_each_call() -> None:
    """Hooks on a submodule are refused for the module as a whole (compiled code would not run
    them); dispatched by itself, the submodule's own hooks run around each of its calls."""
    torch.manual_seed(0)
    model = Block()
    ref = copy.deepcopy(model)
    seen: dict[str, list[torch.Tensor]] = {"tvm": [], "eager": []}
    model.fc1.register_forward_hook(lambda mod, args, out: seen["tvm"].append(out.detach()))
    ref.fc1.register_forward_hook(lambda mod, args, out: seen["eager"].append(out.detach()))
    with pytest.warns(FallbackWarning, match="hooks on Block's submodules.*submodules run on TVM by themselves"):
        add_tvm_dispatch(model, (torch.randn(3, 8),), fallback=True)
    for _ in range(2):
        x = torch.randn(3, 8)
        got, want = model(x), ref(x)
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
    assert model.fc1._tvm_dispatch.calls_tvm == 2 and len(seen["tvm"]) == len(seen["eager"]) == 2
    for got, want in zip(seen["tvm"], seen["eager"]):
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, want)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
