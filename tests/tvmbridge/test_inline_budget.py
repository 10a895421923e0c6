"""The inlining budget: a fused chain whose every link reads the one before twice (Swin's
shifted-window mask, a stack of rolls) keeps some links as blocks instead of an expression that
doubles per link (which took ``compute_inline`` and LLVM minutes); ordinary chains inline whole."""
from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm import relax, s_tir, te, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func

from tvmbridge import devices
from tvmbridge.backend import build, cpu_schedules, inline_budget

TARGET = devices.target_for(torch.device("cpu"))


def _chain(n: int, links: int, link, last=lambda y, x: relax.op.add(y, x)) -> tvm.IRModule:
    """``links`` applications of ``link`` to a (4, n) input, then ``last(y, x)`` (``y + x``): one
    fused kernel."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, n), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for _ in range(links):
                y = bb.emit(link(y, n))
            out = bb.emit_output(last(y, x))
        bb.emit_func_output(out)
    return bb.get()


def _roll(y: relax.Expr, n: int) -> relax.Expr:
    """``torch.roll(y, 1, 1)`` as exported: two slices concatenated (two reads of ``y``)."""
    tail = relax.op.strided_slice(y, axes=[1], begin=[n - 1], end=[n])
    head = relax.op.strided_slice(y, axes=[1], begin=[0], end=[n - 1])
    return relax.op.concat([tail, head], axis=1)


def _scale(y: relax.Expr, n: int) -> relax.Expr:
    return relax.op.multiply(relax.op.add(y, relax.const(1.0)), relax.const(0.5))


def _kernels(mod: tvm.IRModule) -> list[tirx.PrimFunc]:
    fused = tvm.transform.Sequential(
        [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
         relax.transform.FuseTIR()]
    )(mod)  # fmt: skip
    return [f for f in fused.functions.values() if isinstance(f, tirx.PrimFunc)]


def _kept(func: tirx.PrimFunc) -> set[str]:
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    return inline_budget.kept_as_blocks(sch, [i.block_rv for i in infos], {sch.get(infos[-1].block_rv).name_hint})


def test_a_doubling_chain_keeps_blocks_and_computes_the_same_values() -> None:
    n, links = 16, 40  # 2**40 copies of the input if inlined whole
    mod = _chain(n, links, _roll)
    (kernel,) = _kernels(mod)
    kept = _kept(kernel)
    assert kept, "a chain that doubles per link must keep some links as blocks"
    assert len(kept) < links, "only the links past the budget are kept"
    x = np.random.default_rng(0).standard_normal((4, n)).astype("float32")
    vm = build.load(build.compile_module(mod, TARGET), torch.device("cpu"))
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_array_equal(got, np.roll(x, links, axis=1) + x)


def _rolls_then_sum(n: int, links: int) -> tirx.PrimFunc:
    """One kernel: ``links`` rolls of a (4, n) input (each reading the last twice), then
    ``sum(y * x, axis=1)``, as a fused reduction with that prologue would be."""
    x = te.placeholder((4, n), name="x")

    def roll(y: te.Tensor, i: int) -> te.Tensor:
        return te.compute((4, n), lambda a, b: tirx.if_then_else(b == 0, y[a, n - 1], y[a, b - 1]), name=f"r{i}")

    y = x
    for i in range(links):
        y = roll(y, i)
    k = te.reduce_axis((0, n), name="k")
    out = te.compute((4,), lambda a: te.sum(y[a, k] * x[a, k], axis=k), name="out")
    return te.create_prim_func([x, out])


def test_a_reduction_after_a_doubling_chain_is_scheduled_and_right() -> None:
    """The reduction rules inline every block: they leave such a kernel to the next rule, or
    unscheduled (serial), instead of copying the chain whole."""
    n, links = 16, 40
    func = _rolls_then_sum(n, links)
    assert _kept(func)
    with TARGET:
        sch = cpu_schedules.default_cpu_schedule(func, TARGET)
    lib = tvm.compile(sch.mod if sch is not None else tvm.IRModule({"main": func}), target=TARGET)
    x = np.random.default_rng(0).standard_normal((4, n)).astype("float32")
    out = tvm.runtime.tensor(np.zeros(4, "float32"))
    lib["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), (np.roll(x, links, axis=1) * x).sum(1), rtol=1e-5, atol=1e-5)


def test_an_ordinary_chain_inlines_whole() -> None:
    (kernel,) = _kernels(_chain(16, 40, _scale))
    assert _kept(kernel) == set()


def test_the_estimate_counts_each_read() -> None:
    """Ten links of two reads each pass a budget of a thousand nodes; one read each does not."""
    (rolls,) = _kernels(_chain(16, 10, _roll))
    (scales,) = _kernels(_chain(16, 10, _scale))
    for func, expect_kept in ((rolls, True), (scales, False)):
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        out = {sch.get(infos[-1].block_rv).name_hint}
        assert bool(inline_budget.kept_as_blocks(sch, [i.block_rv for i in infos], out, limit=1000)) == expect_kept
