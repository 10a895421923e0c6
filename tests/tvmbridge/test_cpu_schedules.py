"""The CPU schedule rules on small kernels: each rule fires where it should (checked in the
scheduled TIR), leaves alone what it should not, and the compiled kernel matches numpy."""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, tirx
from tvm.target.codegen import llvm_get_vector_width

from tvmbridge import devices
from tvmbridge.backend import build, cpu_schedules

# the rules as they schedule for a TVM thread pool of several threads (a one-thread target, every
# 2-vCPU machine's, makes no loop parallel: tested apart)
TARGET = tvm.target.Target({**dict(devices.target_for(torch.device("cpu")).export()), "num-cores": 4})
ONE_THREAD = tvm.target.Target({**dict(TARGET.export()), "num-cores": 1})


GRAIN = cpu_schedules.MIN_PARALLEL_ELEMENTS


@pytest.fixture(autouse=True)
def _any_size_may_run_parallel(monkeypatch):
    """The rules' loops at the small sizes these tests use, as a large kernel would get them (the
    size below which a kernel stays serial is tested on its own)."""
    monkeypatch.setattr(cpu_schedules, "MIN_PARALLEL_ELEMENTS", 0)


def _module(shape: tuple[int, ...], body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(x))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod: tvm.IRModule) -> str:
    lowered = build.lower(mod, TARGET)
    return "\n".join(f.script() for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc))


def _run(mod: tvm.IRModule, x: np.ndarray) -> np.ndarray:
    vm = build.load(build.compile_module(mod, TARGET), torch.device("cpu"))
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("n", [128, 50], ids=["vector-multiple", "ragged"])
def test_softmax_row_reduction(n):
    mod = _module((6, 10, n), lambda x: relax.op.nn.softmax(x, axis=-1))
    tir = _kernels(mod)
    # the reduction runs on partial vectors (rfactor) on either row length; a ragged row's last
    # vector is partial, under a likely predicate that LoopPartition peels off (compute_at drops the
    # split's own predicate from the partials: restored, else the last vector reads past the row)
    assert "_rf" in tir
    assert ("T.likely" in tir) == (n % 16 != 0)
    assert "T.parallel" in tir
    np.testing.assert_allclose(_run(mod, _x((6, 10, n))), _softmax(_x((6, 10, n))), rtol=1e-5, atol=1e-6)


def test_row_sum_ending_in_the_reduction():
    mod = _module((64, 256), lambda x: relax.op.sum(relax.op.multiply(x, x), axis=[1], keepdims=True))
    tir = _kernels(mod)
    assert "_rf" in tir and "T.vectorized" in tir
    x = _x((64, 256))
    np.testing.assert_allclose(_run(mod, x), (x * x).sum(1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("n", [1003, 16 * 40 + 1])
def test_ragged_row_exp_sum_and_broadcast_log(n):
    """A vocabulary-sized row length no multiple of the vector (log-softmax's sum of exps): right
    (no read past a row's end), and the per-row ``log`` read by the final subtract is computed
    once per row, not inlined into every element."""
    def log_softmax(x):
        shifted = relax.op.subtract(x, relax.op.max(x, axis=[1], keepdims=True))
        lse = relax.op.log(relax.op.sum(relax.op.exp(shifted), axis=[1], keepdims=True))
        return relax.op.subtract(shifted, lse)

    mod = _module((8, n), log_softmax)
    tir = _kernels(mod)
    logs = [f for f in tir.split("@T.prim_func") if "T.log(" in f]
    assert logs and all(re.search(r"T\.log\(\w+\[v0, T\.int64\(0\)\]\)", f) for f in logs), logs
    x = _x((8, n)) * 4
    x[:, :16] = 50.0  # a row that read past its end (the next row's start) would take this max
    want = torch.from_numpy(x).log_softmax(-1).numpy()
    np.testing.assert_allclose(_run(mod, x), want, rtol=1e-5, atol=1e-5)


def test_per_row_operands_are_computed_inside_the_parallel_row_loop():
    """An elementwise kernel reading per-row values (LayerNorm's backward: a row's scale, its
    mean's gradient) computes them under the parallel row loop, once per row, not in serial loops
    over all rows before it (which LLVM unrolls in full: most of such a kernel's build time)."""
    rows, n = 64, 256
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, n), "float32"))
    s = relax.Var("s", relax.TensorType((rows, 1), "float32"))
    with bb.function("main", [x, s]):
        with bb.dataflow():
            scale = relax.op.divide(relax.const(0.5, "float32"), s)
            shift = relax.op.multiply(s, relax.const(3.0, "float32"))
            out = bb.emit_output(relax.op.subtract(relax.op.multiply(x, scale), shift))
        bb.emit_func_output(out)
    mod = bb.get()
    kernels = [f for f in _kernels(mod).split("@T.prim_func") if "T_divide" in f]
    assert len(kernels) == 1
    body = kernels[0]
    assert "T.parallel" in body and "sblock(\"T_" not in body[: body.index("T.parallel")], body
    xv, sv = _x((rows, n)), _x((rows, 1), seed=1) + 3
    vm = build.load(build.compile_module(mod, TARGET), torch.device("cpu"))
    got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(sv)).numpy()
    want = xv * (np.float32(0.5) / sv) - sv * np.float32(3.0)
    np.testing.assert_array_equal(got, want)


def test_a_chain_of_per_row_operands_moves_into_the_row_loop_together():
    """A per-row operand computed from another per-row value (LayerNorm's backward in
    MobileViT: a row's scale from its variance): the whole chain moves under the parallel row
    loop. The producer's shape check once raised inside the rule, which left the kernel
    unscheduled (serial, every block its own loop) without a word."""
    rows, n = 64, 256

    def scaled(x, s):
        var = relax.op.add(relax.op.multiply(s, s), relax.const(1.0, "float32"))
        return relax.op.multiply(x, relax.op.divide(relax.const(0.5, "float32"), var))

    mod = _function({"x": ((rows, n), "float32"), "s": ((rows, 1), "float32")}, scaled)
    (body,) = [f for f in _kernels(mod).split("@T.prim_func") if "T_divide" in f]
    assert "T.parallel" in body and "sblock(\"T_" not in body[: body.index("T.parallel")], body
    xv, sv = _x((rows, n)), _x((rows, 1), seed=1)
    np.testing.assert_array_equal(_run_many(mod, xv, sv), xv * (np.float32(0.5) / (sv * sv + np.float32(1.0))))


def test_a_column_operand_is_computed_once_before_the_row_loop():
    """An operand every row reads whole (a bias cast to float32 under autocast) is not moved
    into the row loop: that would compute it again for every row."""
    rows, n = 64, 256
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, n), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float64"))
    with bb.function("main", [x, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, relax.op.astype(b, "float32")))
        bb.emit_func_output(out)
    mod = bb.get()
    (body,) = [f for f in _kernels(mod).split("@T.prim_func") if "T_add" in f]
    cast = body.index('sblock("compute"') if 'sblock("compute"' in body else body.index('sblock("T_cast')
    assert cast < body.index("T.parallel"), body
    xv, bv = _x((rows, n)), _x((n,), seed=1).astype("float64")
    vm = build.load(build.compile_module(mod, TARGET), torch.device("cpu"))
    got = vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(bv)).numpy()
    np.testing.assert_array_equal(got, xv + bv.astype("float32"))


def test_column_sum_is_not_a_row_reduction():
    """A bias gradient's sum over rows reads columns strided: no row rfactor; the column rule
    (threads own column blocks) takes it."""
    mod = _module((256, 64), lambda x: relax.op.sum(x, axis=[0]))
    tir = _kernels(mod)
    assert "_rf" not in tir and "T.parallel" in tir
    x = _x((256, 64))
    np.testing.assert_allclose(_run(mod, x), x.sum(0), rtol=1e-4, atol=1e-4)


def test_layer_norm_statistics():
    def body(x):
        mean = relax.op.mean(x, axis=[-1], keepdims=True)
        var = relax.op.variance(x, axis=[-1], keepdims=True)
        return relax.op.divide(relax.op.subtract(x, mean), relax.op.sqrt(relax.op.add(var, relax.const(1e-5))))

    mod = _module((32, 96), body)
    assert "_rf" in _kernels(mod)
    x = _x((32, 96))
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(_run(mod, x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape,axes", [((4, 32, 6, 64), [0, 2, 3, 1]), ((4, 30, 6, 64), [0, 2, 3, 1])],
                         ids=["tiled", "ragged"])
def test_transpose_tiles(shape, axes):
    """Attention's head split: (b, s, h, d) -> (b, h, d, s). The output's inner axis (s) is
    strided in the input; tiles of 16x16 when both axes split evenly."""
    mod = _module(shape, lambda x: relax.op.permute_dims(x, axes))
    tile = re.search(r"for \w+ in range\(T\.int64\((\d+)\)\):\s*\n\s*for \w+ in T\.vectorized\(T\.int64\(\1\)\)",
                     _kernels(mod))
    assert (tile is not None) == (shape[1] % 16 == 0)  # a lanes x lanes tile, inner part vectors
    x = _x(shape)
    np.testing.assert_array_equal(_run(mod, x), x.transpose(axes))


def test_max_pool_gradient_is_not_left_to_a_rule_that_mis_schedules_it():
    """max-pool's gradient is a tuple reduction (argmax and max together); dlight's cpu.Reduction
    gave wrong input gradients for it fused with a residual add (found by the property test)."""
    from tvmbridge import add_tvm_dispatch

    from ..helpers import clone_module, relative_errors, run_step

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool, self.fc = torch.nn.MaxPool2d(3, 1, 1), torch.nn.Linear(4 * 6 * 6, 6)

        def forward(self, x):
            return self.fc((x + self.pool(x)).flatten(1))

    torch.manual_seed(0)
    m = Residual()
    ref = clone_module(m)
    x = torch.randn(3, 4, 6, 6)
    add_tvm_dispatch(m, (x,))
    errs = relative_errors(run_step(m, (x,)), run_step(ref, (x,)))
    assert max(errs.values()) <= 1e-5, errs


_ROW_KERNELS = {
    "exp-sum": (lambda v: relax.op.sum(relax.op.exp(v), axis=[1], keepdims=True),
                lambda a: np.exp(a).sum(1, keepdims=True)),
    "max": (lambda v: relax.op.max(v, axis=[1], keepdims=True), lambda a: a.max(1, keepdims=True)),
    "mean-subtract": (lambda v: relax.op.subtract(v, relax.op.mean(v, axis=[1], keepdims=True)),
                      lambda a: a - a.mean(1, keepdims=True)),
    "softmax": (lambda v: relax.op.nn.softmax(v, axis=-1), _softmax),
}


@pytest.mark.parametrize("n", [128, 50, 1003])
@pytest.mark.parametrize("kernel", list(_ROW_KERNELS))
def test_row_kernels_never_read_past_a_row(kernel, n):
    """Each row starts with large values: a schedule that read past a row's end (a vector split
    whose predicate got lost) would take the next row's into its max or sum."""
    body, ref = _ROW_KERNELS[kernel]
    x = _x((6, n)) * 3
    x[:, :16] = 40.0
    want = ref(x)
    got = _run(_module((6, n), body), x)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("vocab", [1003, 1024])
def test_log_softmax_over_a_ragged_vocabulary(vocab):
    """A language-model loss over a vocabulary that is no multiple of the vector, with fast
    math's written-out log_softmax: the loss and the gradients equal PyTorch's."""
    from tests.helpers import clone_module, relative_errors, run_step
    from tvmbridge import add_tvm_dispatch

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(32, vocab)

        def forward(self, x):
            return self.proj(x).log_softmax(-1)

    torch.manual_seed(0)
    m = Head()
    ref = clone_module(m)
    x = torch.randn(24, 32) * 3
    add_tvm_dispatch(m, (x,))
    fast = m._tvm_dispatch.compiled.stages["fast_math"]["forward"].script()
    assert "R.nn.log_softmax" not in fast and "fast_exp" in fast
    errs = relative_errors(run_step(m, (x,)), run_step(ref, (x,)))
    assert max(errs.values()) <= 2e-6, errs


def test_a_symbolic_elementwise_kernel_vectorizes_its_trailing_static_axes():
    """``(2, n, 8, 8)``: each axis alone is too short for a vector pair, the 64 elements of the
    two static ones together are vectors (a kernel shared across a CNN's widths)."""
    n = tirx.Var("n", "int64")
    mod = _module((2, n, 8, 8), lambda x: relax.op.add(relax.op.multiply(x, x), relax.const(1.0, "float32")))
    tir = _kernels(mod)
    assert "T.vectorized" in tir and "T.parallel" in tir
    x = _x((2, 5, 8, 8))
    np.testing.assert_allclose(_run(mod, x), x * x + 1, rtol=1e-6)


@pytest.mark.parametrize(
    "body,reference",
    [
        (lambda x, y: relax.op.add(relax.op.multiply(x, x), y), lambda x, y: [x * x + y]),
        (lambda x, y: relax.op.concat([relax.op.nn.relu(x), y], axis=1),  # a select between reads
         lambda x, y: [np.concatenate([np.maximum(x, 0), y], 1)]),
        (lambda x, y: relax.op.split(relax.op.add(x, y), 2, axis=1),  # several outputs
         lambda x, y: np.split(x + y, 2, axis=1)),
    ],
    ids=["arithmetic", "concatenate", "split"],
)
def test_a_kernel_of_symbolic_sizes_only_keeps_its_innermost_loop_apart(body, reference):
    """``(2, c, h, w)`` all symbolic (a kernel shared across a CNN's widths and resolutions):
    fused whole, each element's indices were divisions and remainders by runtime sizes (a tenth
    of the speed of memory); the outer loops are fused and parallel, the innermost stays a plain
    loop indexed by itself, and the values are numpy's at several sizes."""
    c, h, w = (tirx.Var(v, "int64") for v in "chw")
    mod = _function({"x": ((2, c, h, w), "float32"), "y": ((2, c, h, w), "float32")}, body)
    tir = _kernels(mod)
    inner = re.findall(r"for (ax\d+) in range\(w\):", tir)
    assert "T.parallel" in tir and inner, tir
    assert all(f"T.axis.spatial(w, {ax})" in tir for ax in inner), tir
    vm = build.load(build.compile_module(mod, TARGET), torch.device("cpu"))
    for shape in [(2, 4, 3, 5), (2, 6, 8, 8), (2, 2, 1, 17)]:
        x, y = _x(shape, 1), _x(shape, 2)
        out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y))
        got = [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]
        want = reference(x, y)
        assert len(got) == len(want)
        for g, r in zip(got, want):
            np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: (x * 2, y.expand(4, 64).contiguous()),  # an expand: the same value along the row
        lambda x, y: (x * 2, torch.zeros(4, 64, dtype=y.dtype) + y[0, 0]),  # a fill from a scalar
        lambda x, y: torch.floor(x * 0.5) + y,  # floor's zero gradient holds a bfloat16(0) constant
    ],
    ids=["expand", "fill", "floor"],
)
def test_a_low_precision_value_the_same_in_every_lane_builds_and_trains(fn, dtype):
    """A bfloat16/float16 kernel whose vector would be broadcast from a scalar (TVM's bfloat16
    storage legalization fails to build it vectorized) stays scalar, and trains as PyTorch."""
    from tests.helpers import Fn, clone_module, is_tvm, max_errors, run_step
    from tvmbridge import add_tvm_dispatch
    from tvmbridge.errors import VerificationWarning

    x, y = (torch.randn(4, 64) * 20).to(dtype), torch.randn(4, 1).to(dtype)
    module = Fn(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", VerificationWarning)  # a discarded variant would pass on PyTorch's numbers
        got = run_step(add_tvm_dispatch(clone_module(module), (x, y)), (x, y))
    assert is_tvm(got[0][0])
    errs = max_errors(got, run_step(module, (x, y)))
    assert max(errs.values()) == 0, errs


def test_a_low_precision_cast_that_varies_along_the_row_stays_vectorized():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 256), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.astype(relax.op.multiply(x, relax.const(2.0)), "bfloat16"))
        bb.emit_func_output(out)
    assert "T.vectorized" in _kernels(bb.get())


def _run_many(mod: tvm.IRModule, *args: np.ndarray):
    vm = build.load(build.compile_module(mod, TARGET), torch.device("cpu"))
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]


def _function(params: dict[str, tuple[tuple[int, ...], str]], body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    vs = [relax.Var(n, relax.TensorType(shape, dtype)) for n, (shape, dtype) in params.items()]
    with bb.function("main", vs):
        with bb.dataflow():
            out = bb.emit_output(body(*vs))
        bb.emit_func_output(out)
    return bb.get()


def test_a_kernel_with_several_outputs_gets_a_parallel_vectorized_loop_per_output():
    """A fused ``split`` (GhostNet's, LeViT's attention heads) writes several outputs: the rule
    once refused it whole, and it ran serial, every block its own loop."""
    mod = _function(
        {"x": ((64, 384), "float32")},
        lambda x: relax.op.split(relax.op.multiply(relax.op.exp(x), relax.const(0.5, "float32")), [128], axis=1),
    )
    (body,) = [f for f in _kernels(mod).split("@T.prim_func") if "T_split" in f]
    assert body.count("T.parallel") == 2 and body.count("T.vectorized") == 2, body
    x = _x((64, 384))
    got = _run_many(mod, x)
    want = np.exp(x) * np.float32(0.5)
    np.testing.assert_allclose(got[0], want[:, :128], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[:, 128:], rtol=1e-6)


def test_a_kernel_flatten_would_miscompile_fused_runs_parallel_unfused():
    """CoaT's class-token concatenation after a reshape and transpose reads ``(v1 - 1) // 2``:
    fused, ``FlattenBuffer`` would miscompile it, so the fused schedule is refused; the kernel now
    keeps its loops (outermost parallel, innermost vectorized) instead of running serial."""
    from tvmbridge.backend.flatten_hazard import flatten_hazard

    def body(x, y):
        t = relax.op.reshape(relax.op.multiply(x, relax.const(2.0, "float32")), (8, 256, 4))
        return relax.op.add(relax.op.concat([y, relax.op.permute_dims(t, [0, 2, 1])], axis=1), relax.const(1.0))

    mod = _function({"x": ((8, 256, 2, 2), "float32"), "y": ((8, 1, 256), "float32")}, body)
    raw = [f for f in build.lower(mod, TARGET, schedule=False).functions.values() if isinstance(f, tirx.PrimFunc)]
    with TARGET:
        fused = cpu_schedules.Elementwise().apply(raw[0], TARGET, False)
    assert fused is not None and flatten_hazard(fused.mod["main"]) is not None  # the case is still a hazard
    lowered = [f for f in build.lower(mod, TARGET).functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(lowered) == 1 and "T.parallel" in lowered[0].script()
    assert flatten_hazard(lowered[0]) is None
    x, y = _x((8, 256, 2, 2)), _x((8, 1, 256), seed=1)
    want = np.concatenate([y, (x * 2).reshape(8, 256, 4).transpose(0, 2, 1)], axis=1) + 1
    np.testing.assert_array_equal(_run_many(mod, x, y), want)


def test_a_batch_norm_chain_is_one_loop_per_channel_operand():
    """BatchNorm's per-channel scale and shift, computed from the variance in several steps
    (float64 as ATen, a square root, divisions), inlined into one loop per operand: one loop a
    step made LLVM vectorize and unroll each (half a second of object code per such kernel of a
    RepVGG block), for a few hundred channels of work."""
    c = 48

    def body(x, mean, var, w, b):
        wide = relax.op.astype(relax.op.add(var, relax.const(1e-5, "float32")), "float64")
        invstd = relax.op.astype(relax.op.divide(relax.const(1.0, "float64"), relax.op.sqrt(wide)), "float32")
        scale = relax.op.multiply(w, invstd)
        shift = relax.op.subtract(b, relax.op.multiply(mean, scale))
        return relax.op.add(
            relax.op.multiply(x, relax.op.reshape(scale, (1, c, 1, 1))), relax.op.reshape(shift, (1, c, 1, 1))
        )

    vec = ((c,), "float32")
    mod = _function({"x": ((2, c, 16, 16), "float32"), "mean": vec, "var": vec, "w": vec, "b": vec}, body)
    (kernel,) = [f for f in _kernels(mod).split("@T.prim_func") if "T_add" in f]
    before = kernel[: kernel.index("T.parallel")]
    assert before.count("T.sblock(") - before.count("# with T.sblock(") == 2, kernel  # scale and shift
    rng = np.random.default_rng(0)
    x = _x((2, c, 16, 16))
    mean, w, b = (rng.standard_normal(c).astype("float32") for _ in range(3))
    var = rng.random(c).astype("float32")
    invstd = (1.0 / np.sqrt((var + np.float32(1e-5)).astype("float64"))).astype("float32")
    scale = w * invstd
    shift = b - mean * scale
    want = x * scale.reshape(1, c, 1, 1) + shift.reshape(1, c, 1, 1)
    np.testing.assert_array_equal(_run_many(mod, x, mean, var, w, b), want)


def test_an_output_read_by_another_output_is_written_first():
    """An output block that a later output reads (a fused function returning a value and one
    computed from it) cannot be inlined: each output gets its own loop nest, in program order,
    so the reader sees every element written (here reversed along the row: another thread's)."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def two(x: T.Buffer((64, 256), "float32"), a: T.Buffer((64, 256), "float32"), b: T.Buffer((64, 256), "float32")):
        for i, j in T.grid(64, 256):
            with T.sblock("a"):
                vi, vj = T.axis.remap("SS", [i, j])
                a[vi, vj] = x[vi, vj] * T.float32(3.0)
        for i, j in T.grid(64, 256):
            with T.sblock("b"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = a[63 - vi, 255 - vj] + T.float32(1.0)

    with TARGET:
        sch = cpu_schedules.Elementwise().apply(two, TARGET, False)
    assert sch is not None and sch.mod["main"].script().count("T.parallel") == 2
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=TARGET)
    x = _x((64, 256))
    a, b = tvm.runtime.tensor(np.zeros_like(x)), tvm.runtime.tensor(np.zeros_like(x))
    lib["main"](tvm.runtime.tensor(x), a, b)
    np.testing.assert_array_equal(a.numpy(), x * np.float32(3.0))
    np.testing.assert_array_equal(b.numpy(), (x * np.float32(3.0))[::-1, ::-1] + np.float32(1.0))


def test_a_one_thread_target_makes_no_loop_parallel():
    """Where TVM's pool has one thread (``devices.cpu_threads``), a parallel loop only adds its
    launch to each call: every kernel's loops serial, still vectorized, values unchanged."""
    mod = _module((6, 10, 128), lambda x: relax.op.nn.softmax(relax.op.multiply(x, x), axis=-1))
    lowered = build.lower(mod, ONE_THREAD)
    tir = "\n".join(f.script() for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc))
    assert "T.parallel" not in tir and "T.vectorized" in tir, tir
    assert "T.parallel" in _kernels(mod)
    vm = build.load(build.compile_module(mod, ONE_THREAD), torch.device("cpu"))
    x = _x((6, 10, 128))
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), _softmax(x * x), rtol=1e-5, atol=1e-6)



def test_a_kernel_below_pytorch_s_grain_stays_serial(monkeypatch):
    """Starting threads costs more than a small kernel's work (PyTorch's own ops stay on one
    thread below 32768 elements): every loop of a kernel whose tensors are all smaller is serial,
    still vectorized; one as large is parallel."""
    monkeypatch.setattr(cpu_schedules, "MIN_PARALLEL_ELEMENTS", GRAIN)
    small = (4, 8192 - 64)  # every tensor just below the grain
    for shape, parallel in ((small, False), ((4, 8192), True)):
        mod = _module(shape, lambda x: relax.op.nn.softmax(relax.op.multiply(x, x), axis=-1))
        tir = _kernels(mod)
        assert ("T.parallel" in tir) == parallel and "T.vectorized" in tir, tir
        x = _x(shape)
        np.testing.assert_allclose(_run(mod, x), _softmax(x * x), rtol=1e-5, atol=1e-6)


def _channel_sums(x: relax.Expr) -> relax.Expr:
    """A train-mode BatchNorm's statistic: float64 sums over N, H, W per channel."""
    return relax.op.sum(relax.op.astype(x, "float64"), axis=[0, 2, 3], keepdims=True)


@pytest.mark.parametrize("shape", [(4, 8, 16, 16), (3, 5, 5, 3)], ids=["vector-multiple", "ragged-map"])
def test_per_channel_sums_over_n_h_w_are_vector_partial_sums(shape):
    """A sum over N, H and W keeping C: lanes of partial sums along H x W (an rfactor block),
    channels in parallel, where H x W is a whole number of vectors; a map that is not (5 x 3)
    keeps the serial rule. The sums equal numpy's float64 sums either way."""
    mod = _module(shape, _channel_sums)
    tir = _kernels(mod)
    with TARGET:
        lanes = max(llvm_get_vector_width(TARGET), 128) // 64  # float64 partial sums
    if (shape[2] * shape[3]) % lanes == 0 and shape[2] * shape[3] >= 2 * lanes:
        assert "_rf" in tir and "T.vectorized" in tir and "T.parallel" in tir, tir
    else:
        assert "_rf" not in tir, tir
    x = _x(shape)
    np.testing.assert_allclose(_run(mod, x), x.astype("float64").sum((0, 2, 3), keepdims=True), rtol=1e-12)


def test_a_channel_sum_of_a_product_reads_both_operands_in_vectors():
    """BatchNorm's backward: sum over N, H, W of grad * (x - mean), the mean a per-channel operand."""

    def body(x):
        mean = relax.op.mean(x, axis=[0, 2, 3], keepdims=True)
        return relax.op.sum(
            relax.op.astype(relax.op.multiply(x, relax.op.subtract(x, mean)), "float64"), axis=[0, 2, 3]
        )

    mod = _module((2, 4, 8, 8), body)
    assert "_rf" in _kernels(mod)
    x = _x((2, 4, 8, 8))
    want = (x * (x - x.mean((0, 2, 3), keepdims=True))).astype("float64").sum((0, 2, 3))
    np.testing.assert_allclose(_run(mod, x), want, rtol=1e-5)


def test_a_sum_whose_contiguous_axis_is_kept_is_not_a_channel_reduction():
    """NHWC-like: the innermost axis is kept; the column rule's, no rfactor."""
    mod = _module((4, 16, 64), lambda x: relax.op.sum(x, axis=[0, 1]))
    assert "_rf" not in _kernels(mod)


def _reductions_over_the_last_axis():
    import itertools

    for shape in [(2, 3, 8, 8), (2, 3, 4, 4, 8), (3, 5, 16)]:
        for k in range(1, len(shape)):
            for axes in itertools.combinations(range(len(shape)), k):
                if axes[-1] == len(shape) - 1:
                    yield shape, list(axes)


@pytest.mark.parametrize("shape,axes", list(_reductions_over_the_last_axis()))
@pytest.mark.parametrize("op", ["sum", "max"])
def test_every_reduction_over_the_contiguous_axis_computes_what_numpy_does(shape, axes, op):
    """Whichever rule takes it (row, channel or serial), a reduction over any set of axes that
    ends in the contiguous one, of a float64 product (a BatchNorm gradient's form) or a plain max,
    with kept axes before, between and after the reduced ones."""

    def body(x):
        if op == "sum":
            wide = relax.op.astype(x, "float64")
            return relax.op.sum(relax.op.multiply(wide, wide), axis=axes, keepdims=True)
        return relax.op.max(x, axis=axes)

    x = _x(shape)
    want = (x.astype("float64") ** 2).sum(tuple(axes), keepdims=True) if op == "sum" else x.max(tuple(axes))
    np.testing.assert_allclose(_run(_module(shape, body), x), want, rtol=1e-12 if op == "sum" else 0)
