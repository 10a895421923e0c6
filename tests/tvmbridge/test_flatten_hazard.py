"""Kernels that read at shifted, strided positions (padded pooling and their gradients, a pad
then a strided slice), scheduled for the CPU, against PyTorch with the first-call check off: TVM's
buffer flattening mis-simplifies ``(i - 1) // 2`` over a fused loop (``backend/flatten_hazard.py``),
and a max-pool's input gradient came back wrong with no error before such schedules were refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tvmbridge import add_tvm_dispatch
from tvmbridge.backend.flatten_hazard import flatten_hazard

from ..helpers import Fn
from .test_gradients_nn import randn

COS, SIN = randn(16, 4, seed=3), randn(16, 4, seed=4)  # a rotary table: one angle per position and pair
CASES = {
    "max_pool1d_2": (lambda x: F.max_pool1d(x, 2), (3, 4, 8)),
    "max_pool1d_2_wide": (lambda x: F.max_pool1d(x, 2), (3, 4, 80)),
    "max_pool1d_3_pad": (lambda x: F.max_pool1d(x, 3, 2, 1), (3, 4, 9)),
    "max_pool2d_1x2": (lambda x: F.max_pool2d(x, (1, 2)), (2, 1, 3, 6)),
    "max_pool2d_2": (lambda x: F.max_pool2d(x, 2), (2, 3, 6, 6)),
    "max_pool2d_3_pad": (lambda x: F.max_pool2d(x, 3, 2, 1), (2, 3, 7, 7)),
    "max_pool2d_3_pad_wide": (lambda x: F.max_pool2d(x, 3, 2, 1), (2, 2, 5, 70)),
    "avg_pool2d_3_pad": (lambda x: F.avg_pool2d(x, 3, 2, 1), (2, 3, 7, 7)),
    "avg_pool1d_2": (lambda x: F.avg_pool1d(x, 2), (3, 4, 8)),
    "pad_then_odd_slice": (lambda x: F.pad(x, (1, 1))[..., 1::2] * 2, (3, 4, 8)),
    "pad_then_even_slice": (lambda x: F.pad(x, (1, 0))[..., ::2].exp(), (3, 5, 6)),
    "pixel_unshuffle": (lambda x: F.pixel_unshuffle(F.pad(x, (1, 1, 1, 1)), 2), (2, 2, 4, 6)),
    "upsample_then_shift": (lambda x: F.interpolate(x, scale_factor=2)[..., 1:-1, 1:-1], (2, 2, 3, 5)),
    # DeepSeek-V3's interleaved rotary on the rotary part of heads split from one row: the gradient,
    # inlined into one kernel, places at ``(d % 24 - 17) // 2``, a split made inside the index
    "interleaved_rotary": (lambda x: (lambda r: r[..., 0::2] * COS - r[..., 1::2] * SIN)(
        x.view(2, 16, 4, 24).transpose(1, 2)[..., 16:]), (32, 96)),
    "interleaved_rotary_cat": (lambda x: (lambda r: torch.cat([r[..., 0::2] * COS - r[..., 1::2] * SIN, r[..., 1::2] * COS + r[..., 0::2] * SIN], -1))(
        torch.split(x.view(2, 16, 4, 24).transpose(1, 2), [16, 8], -1)[1]), (32, 96)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_shifted_strided_reads_as_pytorch(name):
    fn, shape = CASES[name]
    x = randn(*shape)
    m = add_tvm_dispatch(Fn(fn), (x,), verify=False, disk_cache=False)
    for seed in (1, 2):
        a = randn(*shape, seed=seed).requires_grad_()
        b = a.detach().clone().requires_grad_()
        got, want = m(a), fn(b)
        g = randn(*want.shape, seed=seed + 10)
        got.backward(g)
        want.backward(g)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


def _placements():
    """The same placement over a (2, 6) output three ways: ``fused`` (one loop split into both
    axes, read at ``(v1 - 1) // 2``: the hazard), ``nested`` (two loops: none) and ``aligned``
    (fused, but the offset a multiple of the divisor: none)."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def fused(g: T.Buffer((2, 3), "float64"), out: T.Buffer((2, 6), "float64")):
        for f in range(12):
            with T.sblock("place"):
                v0 = T.axis.spatial(2, f // 6)
                v1 = T.axis.spatial(6, f % 6)
                out[v0, v1] = T.if_then_else(1 <= v1, g[v0, (v1 - 1) // 2], T.float64(0))

    @T.prim_func(private=True, s_tir=True)
    def nested(g: T.Buffer((2, 3), "float64"), out: T.Buffer((2, 6), "float64")):
        for i, j in T.grid(2, 6):
            with T.sblock("place"):
                v0, v1 = T.axis.remap("SS", [i, j])
                out[v0, v1] = T.if_then_else(1 <= v1, g[v0, (v1 - 1) // 2], T.float64(0))

    @T.prim_func(private=True, s_tir=True)
    def aligned(g: T.Buffer((2, 3), "float64"), out: T.Buffer((2, 6), "float64")):
        for f in range(12):
            with T.sblock("place"):
                v0 = T.axis.spatial(2, f // 6)
                v1 = T.axis.spatial(6, f % 6)
                out[v0, v1] = g[v0, (v1 + 2) // 2 - 1]

    return fused, nested, aligned


def test_a_split_made_inside_the_index_is_a_hazard():
    """No fused loop, but the index splits its own variable (``v1 % 24``) and divides the part with
    an odd offset: inlined elementwise schedules make this, and the kernel came back wrong."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def inner(g: T.Buffer((2, 4), "float64"), out: T.Buffer((2, 24), "float64")):
        for i, j in T.grid(2, 24):
            with T.sblock("place"):
                v0, v1 = T.axis.remap("SS", [i, j])
                out[v0, v1] = T.if_then_else(17 <= v1 % 12 * 2, g[v0, (v1 % 12 - 9) // 2], T.float64(0))

    assert "split of its own" in flatten_hazard(inner)


def test_a_tuned_schedule_with_the_hazard_is_not_applied(monkeypatch):
    """A MetaSchedule record whose schedule fuses loops under such an index is left out: the
    kernel goes to the default rules, as an untuned one."""
    import tvm
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    from tvmbridge.backend import tuning

    fused, nested, _ = _placements()
    mod = tvm.IRModule({"k": nested})

    class ApplyHazard:
        def __call__(self, m):
            out = m.clone()
            out["k"] = fused.with_attr("tirx.is_scheduled", True)
            return out

    monkeypatch.setattr(tuning.relax.transform, "MetaScheduleApplyDatabase", ApplyHazard)
    tuned, missing = tuning.apply_database(mod, tvm.target.Target("llvm"), ms.database.MemoryDatabase())
    assert missing == ["k"] and tvm_ffi.structural_equal(tuned["k"], nested)


def test_the_hazard_is_named():
    fused, nested, aligned = _placements()
    assert "divides" in flatten_hazard(fused)
    assert flatten_hazard(nested) is None
    assert flatten_hazard(aligned) is None


def test_tvm_still_mis_simplifies_the_offset_division():
    """Pins TVM's own behaviour (as ``test_tvm_workarounds.py`` does): ``IterMapSimplify``, which
    ``FlattenBuffer`` runs on every flattened index, turns ``(f // 6) * 3 + (f % 6 - 1) // 2``
    (equal to ``(f - 1) // 2``) into an expression wrong at every ``f``. A TVM that fixes it fails
    here: ``FlattenSafe`` can then go."""
    import tvm
    from tvm import sym, tirx

    f = tirx.Var("f", "int64")

    def i64(v: int) -> tirx.IntImm:
        return tirx.const(v, "int64")

    expr = tirx.floordiv(f, i64(6)) * i64(3) + tirx.floordiv(tirx.floormod(f, i64(6)) - i64(1), i64(2))
    (simplified,) = sym.iter_map_simplify([expr], {f: tvm.ir.Range(i64(0), i64(12))}, True)

    def at(e, v: int) -> int:
        a = sym.Analyzer()
        a.bind(f, tvm.ir.Range(i64(v), i64(v + 1)))
        return int(a.simplify(e).value)

    assert [at(expr, v) for v in range(12)] == [(v - 1) // 2 for v in range(12)]
    assert all(at(simplified, v) != (v - 1) // 2 for v in range(12)), simplified
