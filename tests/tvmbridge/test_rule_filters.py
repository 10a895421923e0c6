"""Which kernels the CPU reduction rules may take (``backend/rule_filters.py``): decided from the
kernel's blocks, without building a schedule, and the same decision the rules make themselves."""
from __future__ import annotations

import warnings

import pytest
import torch
import tvm_ffi
from tvm import relax, te, tirx
from tvm.s_tir import dlight

from tvmbridge import devices
from tvmbridge.backend import build, cpu_schedules, elementwise_rule
from tvmbridge.backend.flatten_hazard import FlattenSafe
from tvmbridge.backend.rule_filters import Guarded, ReductionKernels, ScheduleRuleWarning, blocks, reduces
from tvmbridge.ir import first_schedule

from .test_cpu_schedules import _module

TARGET = devices.target_for(torch.device("cpu"))
R = relax.op


class Spy(dlight.cpu.Reduction):
    """dlight's rule, counting the kernels it is asked about."""

    def __init__(self) -> None:
        self.asked = 0

    def apply(self, func, target, tunable):
        self.asked += 1
        return super().apply(func, target, tunable)


def _kernels(shape: tuple[int, ...], body) -> list[tirx.PrimFunc]:
    """The fused, unscheduled kernels of ``body`` over an input of ``shape``."""
    lowered = build.lower(_module(shape, body), TARGET, schedule=False)
    return [f for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc)]


_BODIES = {
    "gelu-like chain": ((8, 64), lambda x: R.multiply(R.tanh(x), R.add(x, relax.const(1.0)))),
    "transpose": ((16, 24), lambda x: R.permute_dims(R.exp(x), [1, 0])),
    "broadcast add": ((8, 64), lambda x: R.add(x, R.sum(x, axis=[0], keepdims=True))),
    "softmax": ((8, 64), lambda x: R.nn.softmax(x, axis=-1)),
    "row sum": ((8, 64), lambda x: R.sum(R.exp(x), axis=[1])),
    "column sum": ((64, 8), lambda x: R.sum(x, axis=[0])),
    "argmax": ((8, 64), lambda x: R.argmax(x, axis=1)),
    "layer norm stats": ((8, 64), lambda x: R.subtract(x, R.mean(x, axis=[1], keepdims=True))),
}


@pytest.mark.parametrize("name", list(_BODIES))
def test_the_filtered_rules_schedule_each_kernel_as_the_rules_alone(name):
    """The filter only passes on kernels the rules refuse: every kernel gets the schedule the
    unfiltered rules give it."""
    shape, body = _BODIES[name]
    unfiltered = [
        Guarded(FlattenSafe(r))
        for r in [
            cpu_schedules.RowReduction(),
            ReductionKernels(dlight.cpu.Reduction(), single_output=True).rule,
            cpu_schedules.Elementwise(),
            cpu_schedules.SpatialParallel(),
        ]
    ]
    with TARGET:
        for kernel in _kernels(shape, body):
            got = first_schedule(cpu_schedules.cpu_rules(), kernel, TARGET)
            want = first_schedule(unfiltered, kernel, TARGET)
            assert (got is None) == (want is None)
            if got is not None:
                assert tvm_ffi.structural_equal(got.mod["main"], want.mod["main"]), kernel.script()


def test_an_elementwise_kernel_never_reaches_the_reduction_rule():
    spy = Spy()
    (kernel,) = _kernels(*_BODIES["gelu-like chain"])
    assert not any(reduces(b) for b in blocks(kernel))
    with TARGET:
        assert ReductionKernels(spy).apply(kernel, TARGET, False) is None
    assert spy.asked == 0
    (row,) = _kernels(*_BODIES["softmax"])[:1]
    with TARGET:
        ReductionKernels(spy).apply(row, TARGET, False)
    assert spy.asked == 1


def test_a_reduction_writing_two_buffers_is_passed_on_with_single_output():
    """max-pool's gradient keeps an argmax and a max in one block: dlight's cpu.Reduction
    mis-schedules such a block, so it never sees one."""
    a = te.placeholder((8, 16), name="a")
    k = te.reduce_axis((0, 16), name="k")
    argmax = te.comm_reducer(
        lambda x, y: (tirx.Select(x[1] >= y[1], x[0], y[0]), tirx.Select(x[1] >= y[1], x[1], y[1])),
        lambda t0, t1: (tirx.const(-1, "int32"), tirx.min_value(t1)),
        name="argmax",
    )
    idx, val = te.compute((8,), lambda i: argmax((k.astype("int32"), a[i, k]), axis=k), name="r")
    out = te.compute((8,), lambda i: val[i] + idx[i].astype("float32"), name="out")
    kernel = te.create_prim_func([a, out])
    assert any(len(b.writes) > 1 for b in blocks(kernel))
    spy = Spy()
    with TARGET:
        assert ReductionKernels(spy, single_output=True).apply(kernel, TARGET, False) is None
        assert spy.asked == 0
        ReductionKernels(spy).apply(kernel, TARGET, False)
    assert spy.asked == 1


class _Raises(cpu_schedules.CPUScheduleRule):
    """A rule that fails: with a Python mistake inside the bridge's code, or as TVM refuses."""

    def __init__(self, own_bug: bool) -> None:
        self.own_bug = own_bug

    def apply(self, func, target, tunable):
        if self.own_bug:
            return elementwise_rule.vector_lanes(target, None, None)  # no schedule: AttributeError in the bridge
        raise tvm_ffi.Error("ScheduleError: the block is not a complete block")


def test_a_mistake_in_a_rule_of_the_bridge_warns_and_a_refusal_does_not():
    """``Guarded`` passes a kernel on when a rule fails; a rule's own Python mistake is not a
    refusal to be swallowed (it once left every LayerNorm-gradient kernel of a model serial)."""
    (func,) = _kernels((8, 64), _BODIES["gelu-like chain"][1])
    with pytest.warns(ScheduleRuleWarning, match="_Raises failed on kernel .*AttributeError"):
        assert Guarded(_Raises(own_bug=True)).apply(func, TARGET, False) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Guarded(_Raises(own_bug=False)).apply(func, TARGET, False) is None


@pytest.mark.parametrize("size", [64, tirx.Var("n", "int64")], ids=["static", "symbolic"])
def test_a_softmax_over_a_middle_axis_is_not_recomputed_for_every_row(size):
    """CoaT's factorized attention takes a softmax over the tokens, not the innermost axis: dlight's
    CPU reduction rule computed the whole maximum and sum again at every output row (a tenth of a
    second per call at 3k tokens). Its schedule is refused as repeated work (the counts of block
    runs tell it), the kernel gets one that runs each block about as often as its domain, and the
    values are numpy's."""
    import numpy as np

    from tvmbridge.backend.rule_filters import block_runs, repeated_work

    body = lambda x: R.nn.softmax(x, axis=2)  # noqa: E731
    (kernel,) = _kernels((2, 8, size, 19), body)
    dlights = dlight.cpu.Reduction().apply(kernel, TARGET, False)
    assert dlights is not None and "runs" in repeated_work(kernel, dlights.mod["main"])
    sch = first_schedule(cpu_schedules.cpu_rules(), kernel, TARGET)
    scheduled = sch.mod["main"] if sch is not None else kernel
    assert repeated_work(kernel, scheduled) is None
    base = block_runs(kernel)
    assert all(times <= 2 * base[name] for name, times in block_runs(scheduled).items() if name in base)
    mod = _module((2, 8, size, 19), body)
    vm = build.load(build.compile_module(mod, TARGET), torch.device("cpu"))
    x = np.random.default_rng(0).standard_normal((2, 8, 64, 19)).astype("float32")
    e = np.exp(x - x.max(2, keepdims=True))
    np.testing.assert_allclose(vm["main"](tvm_ffi.from_dlpack(torch.from_numpy(x))).numpy(), e / e.sum(2, keepdims=True),
                               rtol=1e-5, atol=1e-7)
