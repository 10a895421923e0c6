"""Plain globals a forward reads (``runtime/global_reads.py``): the trace compiles their values in,
so the state guard compares them at every call; another value compiles another variant."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tvmbridge import add_tvm_dispatch
from tvmbridge.runtime.global_reads import global_checks

SCALE = 2.0
USE_BIAS_SHIFT = False


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * SCALE
        return h + 1 if USE_BIAS_SHIFT else h


def _shifted(h: torch.Tensor) -> torch.Tensor:
    """A helper of this file the forward calls: its globals count."""
    return h + OFFSET


OFFSET = 0.5


class Helped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _shifted(self.lin(x))


class Outer(nn.Module):
    """The global is read by a submodule's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.other = Scaled(), Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(torch.tanh(self.inner(x)))


@pytest.fixture
def module_globals(monkeypatch: pytest.MonkeyPatch):
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "SCALE", 2.0)
    monkeypatch.setattr(here, "USE_BIAS_SHIFT", False)
    monkeypatch.setattr(here, "OFFSET", 0.5)
    return here


@pytest.mark.parametrize("make", [Scaled, Outer])
def test_a_global_changed_after_compiling_compiles_another_variant(module_globals, make) -> None:
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    add_tvm_dispatch(model, (x,))
    for scale, shift in ((2.0, False), (3.0, False), (3.0, True), (2.0, False)):
        module_globals.SCALE, module_globals.USE_BIAS_SHIFT = scale, shift
        got, want = model(x), ref(x)
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    dispatch = model._tvm_dispatch
    assert dispatch.calls_tvm == 4 and len(dispatch.variants) == 3  # the last call's values had a variant


def test_only_plain_values_are_checked_once_per_forward() -> None:
    model = Outer()
    seen: set[tuple[int, type]] = set()
    checks = [c for m in model.modules() for c in global_checks(m, seen)]
    assert sorted(c[0] for c in checks if not c[4]) == [
        "global SCALE (read by Scaled.forward)",
        "global USE_BIAS_SHIFT (read by Scaled.forward)",
    ]  # torch, nn and the functions are not values: the same objects; the second Scaled is the same code
    by_identity = [c[0] for c in checks if c[4]]
    assert "global torch (read by Outer.forward)" in by_identity and "global F (read by Linear.forward)" in by_identity
    assert len({c[0].split(" (")[0] for c in checks}) == len(checks)  # each global once, whoever reads it


class ClassScaled(nn.Module):
    scale = 2.0  # a class attribute, read as self.scale

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_class_attribute_changed_after_compiling_compiles_another_variant(monkeypatch) -> None:
    """Without the check, the first-call net caught it only while the variant's gradients were
    still unchecked (a VerificationWarning calling it a bug); after that, or with verify off,
    the traced value stayed."""
    torch.manual_seed(0)
    model = ClassScaled()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    add_tvm_dispatch(model, (x,), verify=False)
    model(x).sum().backward()
    monkeypatch.setattr(ClassScaled, "scale", 3.0)
    torch.testing.assert_close(model(x), ref(x))
    assert len(model._tvm_dispatch.variants) == 2 and "class attribute" in model._tvm_dispatch.variants[1].why
    model.scale = 4.0  # an instance attribute now shadows it: a name added since compiling
    torch.testing.assert_close(model(x), ref(x) * 4 / 3)
    assert model._tvm_dispatch.calls_tvm == 3


def test_a_global_read_by_a_helper_of_the_same_file_is_checked(module_globals) -> None:
    torch.manual_seed(0)
    model = Helped()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    add_tvm_dispatch(model, (x,), verify=False)
    torch.testing.assert_close(model(x), ref(x))
    module_globals.OFFSET = -2.0
    torch.testing.assert_close(model(x), ref(x))
    assert (
        len(model._tvm_dispatch.variants) == 2
        and "global OFFSET (read by _shifted)" in model._tvm_dispatch.variants[1].why
    )


CONFIG = {"scale": 2.0, "shift": {"on": False, "by": 0.5}}
ARGS = types.SimpleNamespace(temperature=1.0, _seen=0)


class Configured(nn.Module):
    """Reads a global dict of settings (nested) and a namespace of the script's arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * CONFIG["scale"] / ARGS.temperature
        return h + CONFIG["shift"]["by"] if CONFIG["shift"]["on"] else h


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch):
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "CONFIG", copy.deepcopy(CONFIG))
    monkeypatch.setattr(here, "ARGS", types.SimpleNamespace(**vars(ARGS)))
    return here


def test_global_settings_changed_in_place_or_rebound_compile_another_variant(settings) -> None:
    """A dict entry set in place, a nested one, a namespace's field and the namespace rebound:
    each was compiled in as the first value and, unchecked, kept silently."""
    torch.manual_seed(0)
    model = Configured()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    add_tvm_dispatch(model, (x,), verify=False)
    changes = [
        lambda: None,
        lambda: settings.CONFIG.__setitem__("scale", 3.0),
        lambda: settings.CONFIG["shift"].__setitem__("on", True),
        lambda: setattr(settings.ARGS, "temperature", 0.5),
        lambda: setattr(settings, "ARGS", types.SimpleNamespace(temperature=4.0)),
        lambda: setattr(settings.ARGS, "_seen", 1),  # private: the object's own, not a setting
    ]
    for change in changes:
        change()
        torch.testing.assert_close(model(x), ref(x))
    assert len(model._tvm_dispatch.variants) == 5 and model._tvm_dispatch.calls_tvm == 6
    whys = " ".join(v.why for v in model._tvm_dispatch.variants)
    assert "global CONFIG" in whys and "global ARGS.temperature" in whys


class HelperScaled(nn.Module):
    temperature = 1.0  # read in a helper method, not in forward's own code

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._scaled(self.lin(x))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h / self.temperature


def test_a_class_attribute_read_in_a_helper_method_is_checked(monkeypatch) -> None:
    """The names the trace looked up on the instance (``attribute_reads``) count, not only those
    forward's own code loads: before, ``temperature`` kept its traced value."""
    torch.manual_seed(0)
    model = HelperScaled()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    add_tvm_dispatch(model, (x,), verify=False)
    torch.testing.assert_close(model(x), ref(x))
    monkeypatch.setattr(HelperScaled, "temperature", 2.0)
    torch.testing.assert_close(model(x), ref(x))
    assert len(model._tvm_dispatch.variants) == 2
    assert "HelperScaled.temperature (a class attribute" in model._tvm_dispatch.variants[1].why


def _activation(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h)


class Patchable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.squash(_activation(self.lin(x)))

    def squash(self, h: torch.Tensor) -> torch.Tensor:
        return h * 0.5


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Patchable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_code_patched_after_compiling_compiles_another_variant(monkeypatch) -> None:
    """A method of a submodule's class, its forward, and a helper function of its file, each
    patched after compiling (what a library patching attention does): the compiled code ran the
    old code, silently."""
    torch.manual_seed(0)
    here = sys.modules[__name__]
    model = Holder()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    add_tvm_dispatch(model, (x,), verify=False)
    patches = [
        lambda: None,
        lambda: monkeypatch.setattr(Patchable, "squash", lambda self, h: h * 3.0),
        lambda: monkeypatch.setattr(here, "_activation", torch.sigmoid),
        lambda: monkeypatch.setattr(Patchable, "forward", lambda self, x: self.lin(x) - 1.0),
        lambda: monkeypatch.setattr(nn.Linear, "forward", lambda self, x: F.linear(x, self.weight) * 2.0),
    ]
    for patch in patches:
        patch()
        torch.testing.assert_close(model(x), ref(x))
    d = model._tvm_dispatch
    assert len(d.variants) == 5 and d.calls_tvm == 5
    whys = " ".join(v.why for v in d.variants)
    assert "Patchable.squash (a class attribute" in whys and "global _activation" in whys
