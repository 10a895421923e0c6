"""The state guard's batched checks say "fits" exactly where its per-attribute loop finds no
difference, for every kind of change a user makes to a module after compiling."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tvmbridge.frontend.call_state import ModuleState
from tvmbridge.runtime.state_guard import StateGuard


class Config:
    def __init__(self) -> None:
        self.depth = 2
        self.names = ["a", "b"]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.p = 0.1
        self.flag = True
        self.count = 1
        self.kernel = (3, 3)
        self.table = {"mode": "fast", "sizes": (1, 2)}
        self.tags = {"x", "y"}
        self.config = Config()
        self.scale = torch.tensor(2.0)  # an input of the call (held): any value fits
        self._fixed = torch.tensor(1.0)  # private: compiled in as a constant
        self.cache: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _set(attr: str, value: object) -> Callable[[torch.nn.Module], None]:
    return lambda m: setattr(m.block, attr, value)


def _hook(m: torch.nn.Module) -> None:
    m.block.linear.register_forward_hook(lambda *a: None)


def _marks_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
    output.requires_grad_(True)  # transformers' enable_input_require_grads: acts on its call only


def _call_scoped_hook(m: torch.nn.Module) -> None:
    m.block.linear.register_forward_hook(_marks_output)


CHANGES: dict[str, Callable[[torch.nn.Module], None]] = {
    "a float": _set("p", 0.2),
    "True to 1 (equal, another type)": _set("flag", 1),
    "1 to 1.0": _set("count", 1.0),
    "a tuple": _set("kernel", (3, 5)),
    "a tuple to a list": _set("kernel", [3, 3]),
    "a float to a tensor": _set("p", torch.tensor([0.1, 0.2])),
    "a tensor into a plain dict": lambda m: m.block.table.update(mode=torch.zeros(3)),
    "an entry of a plain dict": lambda m: m.block.table.update(mode="slow"),
    "a plain dict's new key": lambda m: m.block.table.update(extra=None),
    "a set's entry": lambda m: m.block.tags.add("z"),
    "a config field": lambda m: setattr(m.block.config, "depth", 3),
    "a config list in place": lambda m: m.block.config.names.append("c"),
    "the config object": _set("config", Config()),
    "a private tensor reassigned": _set("_fixed", torch.tensor(1.0)),
    "a private tensor written in place": lambda m: m.block._fixed.fill_(3.0),
    "a cache filled": lambda m: m.block.cache.update(k=torch.ones(1)),
    "an attribute deleted": lambda m: delattr(m.block, "p"),
    "an attribute added as None": _set("new", None),
    "a layer appended": lambda m: m.append(torch.nn.Identity()),
    "a parameter registered": lambda m: m.block.register_parameter("extra", torch.nn.Parameter(torch.ones(1))),
    "a buffer registered": lambda m: m.block.register_buffer("extra", torch.ones(1)),
    "a config field added": lambda m: setattr(m.block.config, "dropout", 0.1),
    "a submodule replaced": lambda m: setattr(m.block, "linear", torch.nn.Linear(4, 4)),
    "a forward hook": _hook,
    "eval()": lambda m: m.eval(),
    "a submodule's forward set": lambda m: setattr(m.block.linear, "forward", lambda x: x),
    "a submodule's class swapped": lambda m: setattr(m.block, "__class__", type("Other", (Block,), {})),
}
UNCHANGED: dict[str, Callable[[torch.nn.Module], None]] = {
    "nothing": lambda m: None,
    "an equal float written again": _set("p", 0.1),
    "an equal plain dict": _set("table", {"mode": "fast", "sizes": (1, 2)}),
    "another empty cache dict": _set("cache", {}),
    "a held tensor reassigned": _set("scale", torch.tensor(5.0)),
    "a held tensor written in place": lambda m: m.block.scale.fill_(3.0),
    "train() again": lambda m: m.train(),
    "a hook that acts on its own call only": _call_scoped_hook,
    "a parameter's values": lambda m: m.block.linear.weight.data.add_(1.0),
    "the dispatch's own attributes on the module": lambda m: m.__dict__.update(forward=m.forward, _tvm_dispatch=None),
}


def _guarded() -> tuple[torch.nn.Module, StateGuard]:
    model = torch.nn.Sequential()
    model.add_module("block", Block())
    return model, StateGuard(model, ModuleState.of(model), set())


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_does_not_fit_and_is_named(change: str) -> None:
    model, guard = _guarded()
    assert guard.check(model) is None
    CHANGES[change](model)
    assert not guard.batched.fit()
    mismatch = guard.check(model)
    assert mismatch is not None and ("block" in mismatch.key or change in ("a layer appended", "eval()")), change


@pytest.mark.parametrize("change", list(UNCHANGED))
def test_what_the_compiled_code_does_not_depend_on_still_fits(change: str) -> None:
    model, guard = _guarded()
    UNCHANGED[change](model)
    assert guard.batched.fit() and guard.difference() is None and guard.check(model) is None
    assert guard.batched.layout_sizes == [len(layout[2]) for layout in guard.layouts]  # settled: fast again
    assert not any(guard.batched.hookless)


def test_held_tensors_are_read_at_each_call_and_checked_by_shape() -> None:
    """A tensor kept in a public attribute is an input: the guard reads the one there now (the
    attribute, or an entry of a dict or list read through the attribute) and checks its shape."""
    model, _ = _guarded()
    model.requires_grad_(False)
    model.block.cache["k"] = torch.ones(3)
    guard = StateGuard(model, ModuleState.of(model), set())
    assert set(guard.state.held) == {"block.scale", "block.cache['k']"}
    tensors, why = guard.tensors(model)
    assert why is None and tensors is not None and tensors[-2] is model.block.scale
    model.block.scale = torch.tensor(7.0)
    model.block.cache = {"k": torch.zeros(3)}  # another dict with the same key fits, and is read
    assert guard.check(model) is None
    tensors, _ = guard.tensors(model)
    assert tensors is not None and tensors[-2] is model.block.scale and tensors[-1] is model.block.cache["k"]
    model.block.cache["k"] = torch.zeros(4)
    tensors, why = guard.tensors(model)
    assert tensors is None and why is not None and "cache['k']" in why.message
    model.block.cache = {}
    why = guard.check(model)
    assert why is not None and why.emptied  # the forward refills it: PyTorch runs that call
    model.block.cache = {"other": torch.zeros(3)}
    why = guard.check(model)
    assert why is not None and not why.emptied
