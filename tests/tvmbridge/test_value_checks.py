"""Settings the trace compiles in, held in containers and objects (``runtime/value_checks.py``):
a nested dict entry or a nested config field changed in place after compiling compiles another
variant with PyTorch's numbers (before: the traced value, silently)."""

from __future__ import annotations

import copy
import types

import torch
from torch import nn

from tvmbridge import add_tvm_dispatch
from tvmbridge.runtime.value_checks import TREE_BUDGET, is_plain_tree, value_checks


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.opts = {"scale": {"by": 1.0}, "names": ["a", "b"]}
        self.config = types.SimpleNamespace(text=types.SimpleNamespace(shift=0.0, _cache={}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.opts["scale"]["by"] + self.config.text.shift


def test_nested_settings_changed_in_place_compile_another_variant() -> None:
    torch.manual_seed(0)
    model = Nested()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    add_tvm_dispatch(model, (x,), verify=False)
    edits = [
        lambda m: None,
        lambda m: m.opts["scale"].__setitem__("by", 3.0),
        lambda m: setattr(m.config.text, "shift", 0.5),
        lambda m: setattr(m.config, "text", types.SimpleNamespace(shift=-1.0)),
        lambda m: m.config.text.__dict__.__setitem__("_cache", {"k": 1}),  # private: the object's own
    ]
    for edit in edits:
        edit(model)
        edit(ref)
        out, want = model(x), ref(x)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    d = model._tvm_dispatch
    assert len(d.variants) == 4 and d.calls_tvm == 5
    whys = " ".join(v.why for v in d.variants)
    assert "Nested.opts" in whys and "Nested.config.text.shift" in whys


def test_trees_over_the_budget_and_code_are_not_values() -> None:
    holder = {
        "small": {"a": [1, 2, (3, 4)]},
        "big": list(range(TREE_BUDGET + 1)),
        "obj": types.SimpleNamespace(k=2, inner=types.SimpleNamespace(j=[1]), _own=3),
        "fn": len,
        "cls": nn.Linear,
        "tensor": {"t": torch.zeros(1)},
    }
    assert is_plain_tree(holder["small"]) and not is_plain_tree(holder["big"])
    assert not is_plain_tree(holder["tensor"])
    assert [c[0] for c in value_checks("g", holder, "small")] == ["g"]
    assert value_checks("g", holder, "big") == [] and value_checks("g", holder, "fn") == []
    assert value_checks("g", holder, "cls") == []
    assert [c[0] for c in value_checks("g", holder, "obj")] == ["g", "g.k", "g.inner", "g.inner.j"]


OFFSETS = torch.zeros(4)


class Constants(nn.Module):
    """Tensors the trace compiles in as constants: a global, and a config object's field."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.config = types.SimpleNamespace(gain=torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.config.gain + OFFSETS


def test_constant_tensors_written_in_place_compile_another_variant() -> None:
    torch.manual_seed(0)
    model = Constants()
    ref = copy.deepcopy(model)
    ref.config.gain = model.config.gain  # one config tensor, as a script shares it
    x = torch.randn(3, 4)
    add_tvm_dispatch(model, (x,), verify=False)
    for edit in (lambda: None, lambda: OFFSETS.add_(1.0), lambda: model.config.gain.mul_(2.0)):
        edit()
        torch.testing.assert_close(model(x), ref(x))
    assert len(model._tvm_dispatch.variants) == 3
    OFFSETS.zero_()
