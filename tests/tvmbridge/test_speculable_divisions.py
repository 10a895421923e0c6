"""Divisions by run-time sizes are taken out of loops before LLVM sees them
(``backend/speculable_divisions``): LLVM 22's loop vectorizer computes a loop-invariant division
that sits in a branch only when a vector's first lane takes the branch, and reads at an undefined
address for the vector's other lanes (a symbolic variant's ``where`` over a broadcast operand read
wrong rows; timm's resnet10t segfaulted with a kernel shared across shapes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax, tirx

from tvmbridge import add_tvm_dispatch, devices
from tvmbridge.backend import build, codegen, shared_kernels, speculable_divisions

from ..helpers import clone_module, max_errors, run_step

# a symbolic variant's kernel as the CPU schedules write it: one loop over batch and length fused,
# the batch recovered by a division by the length, read in the branch of a where
BROADCAST_IN_A_BRANCH = """
@T.prim_func(s_tir=True)
def kernel(x: T.handle, y: T.handle, w: T.handle, zero: T.handle, out: T.handle):
    T.func_attr({"global_symbol": "kernel", "tirx.noalias": True})
    s = T.int64()
    X = T.match_buffer(x, (T.int64(2), s, T.int64(16)), "float32")
    Y = T.match_buffer(y, (T.int64(2), T.int64(16)), "float32")
    W = T.match_buffer(w, (T.int64(16),), "float32")
    Z = T.match_buffer(zero, (), "float32")
    O = T.match_buffer(out, (T.int64(2), s, T.int64(16)), "float32")
    for fused, k in T.grid(s * T.int64(2), T.int64(16)):
        with T.sblock("T_where"):
            v0 = T.axis.spatial(T.int64(2), fused // s)
            v1 = T.axis.spatial(s, fused % s)
            v2 = T.axis.spatial(T.int64(16), k)
            O[v0, v1, v2] = T.Select(
                T.int64(0) < T.Cast("int64", T.float32(0.0) < X[v0, v1, v2]), X[v0, v1, v2] * Y[v0, v2] + W[v2], Z[()]
            )
"""


def _inputs(length: int) -> list[np.ndarray]:
    x = np.random.default_rng(0).standard_normal((2, length, 16)).astype("float32")
    x[..., 0::8] = -1.0  # the first lane of every vector takes the other branch
    y = np.random.default_rng(1).standard_normal((2, 16)).astype("float32")
    w = np.random.default_rng(2).standard_normal((16,)).astype("float32")
    return [x, y, w, np.zeros((), "float32")]


def _expected(x, y, w, _zero) -> np.ndarray:
    return np.where(x > 0, x * y[:, None, :] + w, 0)


def _has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="the miscompile is pinned on an AVX-512 target")
def test_llvm_reads_a_wrong_row_where_tvm_builds_the_kernel_as_it_is():
    """TVM's own pipeline on an AVX-512 target without FMA contraction (as the bridge compiles):
    wrong numbers or a crash, in a process of its own. When this fails, LLVM no longer
    miscompiles the kernel and ``speculable_divisions`` can go."""
    script = (
        "from tvm.script import tirx as T\n"
        + BROADCAST_IN_A_BRANCH
        + textwrap.dedent("""
        import numpy as np, tvm
        target = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "mattr": ["-fma"]})
        f = tvm.tirx.build(tvm.IRModule({"kernel": kernel}), target=target, pipeline="default")["kernel"]
        rng = np.random.default_rng
        x = rng(0).standard_normal((2, 40, 16)).astype("float32"); x[..., 0::8] = -1.0
        y, w = rng(1).standard_normal((2, 16)).astype("float32"), rng(2).standard_normal(16).astype("float32")
        out = tvm.runtime.tensor(np.zeros_like(x))
        f(*[tvm.runtime.tensor(a) for a in (x, y, w, np.zeros((), "float32"))], out)
        print(float(np.abs(out.numpy() - np.where(x > 0, x * y[:, None, :] + w, 0)).max()))
    """)
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 or float(done.stdout.split()[-1]) > 1e-3, done.stdout + done.stderr


def _built(pipeline: str) -> tvm.runtime.Module:
    kernel = tvm.script.from_source(BROADCAST_IN_A_BRANCH)
    target = devices.target_for(torch.device("cpu"))
    return tvm.tirx.build(tvm.IRModule({"kernel": kernel}), target=target, pipeline=pipeline)["kernel"]


@pytest.mark.parametrize("length", [1, 7, 8, 40])
def test_the_bridge_s_pipeline_builds_it_right_at_every_length(length):
    f = _built(codegen.tir_pipeline(devices.target_for(torch.device("cpu"))))
    arrays = _inputs(length)
    out = tvm.runtime.tensor(np.zeros((2, length, 16), "float32"))
    f(*[tvm.runtime.tensor(a) for a in arrays], out)
    np.testing.assert_allclose(out.numpy(), _expected(*arrays), rtol=1e-6, atol=1e-6)


def _lowered_kernel() -> tirx.PrimFunc:
    kernel = tvm.script.from_source(BROADCAST_IN_A_BRANCH)
    mod = tvm.IRModule({"kernel": kernel})
    target = devices.target_for(torch.device("cpu"))
    lower, _, _ = tirx.get_tir_pipeline(speculable_divisions.PIPELINE)
    with target:
        return lower(tirx.transform.BindTarget(target.with_host(target))(mod))["kernel"]


def _divisions(node) -> list:
    found: list = []
    tvm_ffi.structural_map(node, [((tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod), lambda d: found.append(d) or d)])
    return found


def _binds(node) -> list[tirx.Bind]:
    found: list[tirx.Bind] = []
    tvm_ffi.structural_map(node, [(tirx.Bind, lambda b: found.append(b) or b)])
    return found


def test_the_division_is_computed_once_per_row_before_the_inner_loop():
    """In the kernel as TVM lowers it, no division by the length is left in the inner loop; each
    is bound before it, by ``max(length, 1)``."""
    inner: list = []

    def visit(loop: tirx.For) -> tirx.For:
        if not _loops(loop.body):  # the innermost loop
            inner.extend(_divisions(loop.body))
        return loop

    kernel = _lowered_kernel()
    tvm_ffi.structural_map(kernel, [(tirx.For, visit)])
    assert all(isinstance(d.b, tirx.IntImm) for d in inner), inner
    hoisted = [b for b in _binds(kernel) if isinstance(b.value, (tirx.FloorDiv, tirx.FloorMod))]
    assert hoisted and all(isinstance(b.value.b, tirx.Max) for b in hoisted)


def _loops(node) -> list[tirx.For]:
    found: list[tirx.For] = []
    tvm_ffi.structural_map(node, [(tirx.For, lambda f: found.append(f) or f)])
    return found


LOOPS = """
@T.prim_func
def f(t: T.handle, o: T.handle):
    n = T.int64()
    table = T.match_buffer(t, (n,), "int64")
    out = T.match_buffer(o, (n, n), "int64")
    for i, j in T.grid(n, n):
        out[i, j] = {value}
"""


@pytest.mark.parametrize(
    ("value", "hoisted"),
    [
        ("i // n + j", 1),  # by a size, the same all through the inner loop: before it
        ("i // (n * n) + (i % n) // n", 3),  # and those built on it, by sizes' products
        ("j // n", 0),  # changes with the inner loop: stays
        ("i // table[0]", 0),  # by a value read from memory: stays
        ("i // (n - 1)", 0),  # by what may be negative: stays
        ("i // 4", 0),  # by a constant: LLVM moves it itself
    ],
)
def test_only_divisions_by_sizes_that_a_loop_does_not_change_move(value, hoisted):
    func = tvm.script.from_source(LOOPS.format(value=value))
    sizes = speculable_divisions.size_vars(tvm.IRModule({"f": func}))
    mapped = speculable_divisions.with_speculable_divisions(func, sizes)
    binds = _binds(mapped)
    assert len(binds) == hoisted, mapped.script()
    assert all(isinstance(b.value.b, tirx.Max) for b in binds), mapped.script()
    innermost = [loop for loop in _loops(mapped) if not _loops(loop.body)]
    assert innermost and not any(_binds(loop) for loop in innermost), mapped.script()


class BroadcastInABranch(torch.nn.Module):
    """A ReLU over ``x * y[:, None, :] + w``: the symbolic variant's forward and backward kernels
    read the broadcast ``y`` in a branch, at a row divided out of a loop over batch and length."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x * y[:, None, :] + self.w, 0.0)


def _torch_inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _, _ = _inputs(length)
    return torch.from_numpy(x), torch.from_numpy(y)


def test_a_symbolic_variant_reads_the_broadcast_operand_right_at_every_length():
    """Before: the second length compiled a symbolic variant whose output was off by up to 3e34
    (the first-call net caught it and ran PyTorch). Now: one symbolic variant, outputs and
    gradients as eager's, the net off."""
    torch.manual_seed(0)
    model = BroadcastInABranch()
    eager = clone_module(model)
    add_tvm_dispatch(model, _torch_inputs(8), verify=False)
    for length in (8, 11, 24, 40):
        args = _torch_inputs(length)
        errors = max_errors(run_step(model, args), run_step(eager, args))
        assert max(errors.values()) < 1e-5, (length, errors)
    assert [v.symbolic for v in model._tvm_dispatch.variants] == [False, True]


def test_a_kernel_shared_across_shapes_reads_a_flattened_operand_right():
    """ReLU's gradient of a ``(C, H*W)`` operand read as ``(C, H, W)`` at 4x4 and 8x8 (timm's
    resnet10t): one kernel for both, its row divided out of a loop over channels and rows; the
    first lane of every vector in the other branch."""
    sizes = [(16, 4, 4), (8, 8, 8)]
    target = tvm.target.Target({**dict(devices.target_for(torch.device("cpu")).export()), "num-cores": 1})
    bb = relax.BlockBuilder()
    params = []
    for i, (c, h, w) in enumerate(sizes):
        params += [relax.Var(f"g{i}", relax.TensorType((2, c, h * w), "float32"))]
        params += [relax.Var(f"{n}{i}", relax.TensorType((2, c, h, w), "float32")) for n in "ra"]
    with bb.function("main", params):
        with bb.dataflow():
            outs = []
            for i, (c, h, w) in enumerate(sizes):
                g, r, a = params[3 * i : 3 * i + 3]
                total = relax.op.add(relax.op.reshape(g, (2, c, h, w)), r)
                zero = relax.const(0.0, "float32")
                outs.append(bb.emit(relax.op.where(relax.op.greater(a, zero), total, zero)))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    mod = bb.get()
    kernels = [f for f in build.lower(mod, target).functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(kernels) == 1 and shared_kernels.largest_tensor(kernels[0]) is not None  # one, shared
    rng = np.random.default_rng(0)
    arrays = []
    for c, h, w in sizes:
        g, r, a = (rng.standard_normal(s).astype("float32") for s in [(2, c, h * w), (2, c, h, w), (2, c, h, w)])
        a[..., 0::8] = -1.0
        arrays += [g, r, a]
    vm = build.load(build.compile_module(mod, target), torch.device("cpu"))
    got = vm["main"](*[tvm.runtime.tensor(x) for x in arrays])
    for i, (c, h, w) in enumerate(sizes):
        g, r, a = arrays[3 * i : 3 * i + 3]
        np.testing.assert_array_equal(got[i].numpy(), np.where(a > 0, g.reshape(2, c, h, w) + r, 0))
