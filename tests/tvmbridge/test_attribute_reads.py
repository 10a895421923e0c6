"""The state guard checks the attributes the trace read (``frontend.attribute_reads``), and only
those: an attribute forward never looked at may change every call without a new trace, one it
read (even one it found missing) still makes one, with PyTorch's numbers."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch

from tvmbridge import RecompileWarning, add_tvm_dispatch
from tvmbridge.frontend.attribute_reads import ReadLog, recorded_reads
from tvmbridge.frontend.export import trace


class Branchy(torch.nn.Module):
    """Reads ``scale`` always, ``boost`` only where ``use_boost``, ``extra`` if it exists."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)
        self.scale, self.use_boost, self.boost = 2.0, False, 3.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale
        if self.use_boost:
            y = y * self.boost
        extra = getattr(self, "extra", None)
        if extra is not None:
            y = y + extra
        return y.tanh()


def _step(m: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    m.zero_grad()
    out = m(x)
    out.square().sum().backward()
    return [out.detach(), *(p.grad.clone() for p in m.parameters())]


def _same_as_eager(m: torch.nn.Module, ref: torch.nn.Module, x: torch.Tensor) -> None:
    for got, want in zip(_step(m, x), _step(ref, x)):
        torch.testing.assert_close(got, want)


def _both(m: torch.nn.Module, ref: torch.nn.Module, **attrs: object) -> None:
    for k, v in attrs.items():
        setattr(m, k, v)
        setattr(ref, k, v)


def test_attributes_never_read_change_freely_and_read_ones_still_retrace() -> None:
    torch.manual_seed(0)
    m, x = Branchy(), torch.randn(3, 6)
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m, (x,), verify=False)
    d = m._tvm_dispatch
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)
        for step in range(5):  # a loop's counter on the model, and an attribute of an untaken branch
            _both(m, ref, global_step=step, boost=3.0 + step)
            _same_as_eager(m, ref, x)
    assert len(d.variants) == 1 and d.calls_tvm == 5 and d.calls_fallback == 0
    _both(m, ref, scale=0.5)  # read: a new variant, its numbers
    _same_as_eager(m, ref, x)
    assert len(d.variants) == 2
    _both(m, ref, use_boost=True)  # the branch taken: boost is read from now on
    _same_as_eager(m, ref, x)
    _both(m, ref, boost=-1.0)
    _same_as_eager(m, ref, x)
    assert len(d.variants) == 4
    _both(m, ref, extra=0.25)  # added, and looked up (found missing) by the trace: a change
    _same_as_eager(m, ref, x)
    assert len(d.variants) == 5 and d.calls_fallback == 0


class ReadsItsDict(torch.nn.Module):
    """Reads its attributes through ``vars(self)``: every one counts as read."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.factor = 1.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * vars(self)["factor"]


def test_a_forward_reading_its_whole_dict_keeps_every_attribute_checked() -> None:
    torch.manual_seed(0)
    m, x = ReadsItsDict(), torch.randn(2, 4)
    ref = copy.deepcopy(m)
    add_tvm_dispatch(m, (x,), verify=False)
    traced = m._tvm_dispatch.variants[0].compiled.traced
    assert id(m) not in traced.attribute_reads and id(m.lin) in traced.attribute_reads
    _both(m, ref, factor=-2.0, unrelated=1)
    _same_as_eager(m, ref, x)
    assert len(m._tvm_dispatch.variants) == 2


def test_the_record_names_reads_per_instance_and_restores_every_class() -> None:
    m = Branchy()
    shared = torch.nn.Linear(6, 4)
    m.lin, m.other = shared, shared  # one instance under two names
    classes = [type(x) for x in m.modules()]
    traced = trace(m, (torch.randn(2, 6),))
    assert [type(x) for x in m.modules()] == classes
    reads = traced.attribute_reads
    assert {"scale", "use_boost", "extra", "lin"} <= reads[id(m)]
    assert "boost" not in reads[id(m)] and "other" not in reads[id(m)]
    assert {"weight", "bias"} <= reads[id(shared)]


class Failing(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_classes_come_back_when_the_block_raises_and_nested_records_share_one_swap() -> None:
    m = torch.nn.Sequential(Failing())
    outer, inner = ReadLog(), ReadLog()
    with pytest.raises(ValueError, match="boom"):
        with recorded_reads(m, outer):
            with recorded_reads(m[0], inner):
                assert type(m[0]) is not Failing and isinstance(m[0], Failing)
                # what export writes into a node's module stack: the user's class's names
                assert (type(m[0]).__module__, type(m[0]).__qualname__) == (Failing.__module__, "Failing")
                m(torch.zeros(1))
    assert type(m) is torch.nn.Sequential and type(m[0]) is Failing
    assert "forward" in inner.names[id(m[0])] and "forward" in outer.names[id(m[0])]
    assert "_modules" in outer.names[id(m)] and id(m) not in inner.names


def test_threads_tracing_one_module_leave_its_class_as_it_was() -> None:
    m, errors = Branchy(), []

    def run() -> None:
        try:
            for _ in range(20):
                with recorded_reads(m, ReadLog()):
                    m(torch.randn(2, 6))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and type(m) is Branchy and type(m.lin) is torch.nn.Linear
