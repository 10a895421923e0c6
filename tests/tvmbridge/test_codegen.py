"""Code generation on every core (``backend/codegen.py``) and legalization done once per distinct
call (``backend/legalize_memo.py``): both must give the code the one-module, call-by-call path
gives, only faster."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax

from tests.helpers import Fn, bert_inputs, bert_layer, clone_module, max_errors, run_step
from tvmbridge.backend import build as backend_build
from tvmbridge.backend import codegen
from tvmbridge import parallel_launch
from tvmbridge.backend.legalize_memo import MemoizedLegalization
from tvmbridge.runtime.compiled import compile_training
from tvmbridge.runtime.dispatch import add_tvm_dispatch, dispatcher_of

TARGET = tvm.target.Target("llvm")


@pytest.fixture(scope="module")
def layer_halves() -> tvm.IRModule:
    """A small BertLayer's split halves, before lowering."""
    torch.manual_seed(0)
    compiled = compile_training(bert_layer(small=True), bert_inputs(hidden=64), verify=False)
    return compiled.stages["fast_math"]


def _kernels(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def test_kernel_groups_hold_every_kernel_once_and_balance_sizes(layer_halves):
    tir = tvm.IRModule(_kernels(backend_build.lower(layer_halves, TARGET)))
    sizes = {gv.name_hint: codegen._kernel_size(f) for gv, f in tir.functions_items()}
    groups = codegen.kernel_groups(tir, 4)
    names = [gv.name_hint for g in groups for gv in g.get_global_vars()]
    assert sorted(names) == sorted(sizes) and len(groups) == 4
    totals = [sum(sizes[gv.name_hint] for gv in g.get_global_vars()) for g in groups]
    assert totals == sorted(totals, reverse=True), "the largest group is built first"
    assert max(totals) <= sum(totals) / 4 + max(sizes.values()), "greedy groups are within one kernel of even"
    assert len(codegen.kernel_groups(tir, 10_000)) == len(sizes)  # never an empty group


def _vm_outputs(exe: tvm.runtime.Executable, mod: tvm.IRModule) -> list[np.ndarray]:
    """The forward run on fixed inputs of the module's parameter types."""
    vm = relax.VirtualMachine(exe, tvm.cpu())
    rng = np.random.default_rng(0)
    func = mod["forward_infer"]
    args = []
    for p in func.params:
        shape = [int(d) for d in p.ty.shape.values]
        dtype = str(p.ty.dtype)
        value = rng.standard_normal(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype)
        args.append(tvm.runtime.tensor(value))
    out = vm["forward_infer"](*args)
    outs = out if isinstance(out, tvm_ffi.Array) else [out]
    return [o.numpy() for o in outs]


def test_kernels_built_in_threads_run_as_one_module_does(layer_halves, tmp_path):
    lowered = backend_build.lower(layer_halves, TARGET)
    pipeline = backend_build.after_lowering(TARGET)
    one = codegen.build_executable(lowered, TARGET, pipeline, threads=1)
    split = codegen.build_executable(lowered, TARGET, pipeline, threads=3)
    assert len(one.mod._collect_dso_modules()) == 1
    assert len(split.mod._collect_dso_modules()) > 1, "the kernels were not built in groups"
    expected = _vm_outputs(one, layer_halves)
    assert expected and all(np.array_equal(a, b) for a, b in zip(expected, _vm_outputs(split, layer_halves), strict=True))
    path = str(tmp_path / "lib.so")
    codegen.write_library(split, path, threads=2)  # objects emitted in threads, linked as one
    loaded = relax.VMExecutable(tvm.runtime.load_module(path))
    assert all(np.array_equal(a, b) for a, b in zip(expected, _vm_outputs(loaded, layer_halves), strict=True))


def _streamed(lowered: tvm.IRModule, replace: dict[str, tvm.tirx.PrimFunc] | None = None) -> codegen.KernelBuilder:
    """A builder handed every kernel of ``lowered`` (``replace``: other code under some names)."""
    kernels = codegen.KernelBuilder(TARGET, threads=2, per_group=3)
    for gv, func in lowered.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            kernels.add(gv, (replace or {}).get(gv.name_hint, func))
    return kernels


def test_kernels_built_while_scheduling_run_as_one_module_does(layer_halves):
    """Kernels handed to the builder as they are scheduled are the executable's code (none built
    twice); the outputs are bit for bit those of the one-module build."""
    lowered = backend_build.lower(layer_halves, TARGET)
    pipeline = backend_build.after_lowering(TARGET)
    expected = _vm_outputs(codegen.build_executable(lowered, TARGET, pipeline, threads=1), layer_halves)
    streamed = codegen.build_executable(lowered, TARGET, pipeline, threads=2, prebuilt=_streamed(lowered))
    libs = streamed.mod._collect_dso_modules()
    assert len(libs) == -(-len(_kernels(lowered)) // 3), "kernels built again after the builder's groups"
    assert all(np.array_equal(a, b) for a, b in zip(expected, _vm_outputs(streamed, layer_halves), strict=True))


def test_a_kernel_built_early_that_the_pipeline_changed_is_not_used(layer_halves):
    """Should the Relax pipeline end with another body for a kernel the builder already compiled,
    everything is built again from the pipeline's module: the early code never runs."""
    lowered = backend_build.lower(layer_halves, TARGET)
    pipeline = backend_build.after_lowering(TARGET)
    expected = _vm_outputs(codegen.build_executable(lowered, TARGET, pipeline, threads=1), layer_halves)
    other = {name: func.with_body(tvm.tirx.Evaluate(0)) for name, func in _kernels(lowered).items()}  # no-ops
    streamed = codegen.build_executable(lowered, TARGET, pipeline, threads=2, prebuilt=_streamed(lowered, other))
    assert all(np.array_equal(a, b) for a, b in zip(expected, _vm_outputs(streamed, layer_halves), strict=True))


def test_a_symbolic_module_builds_its_shape_functions_beside_the_streamed_kernels(monkeypatch):
    """A symbolic variant: the Relax pipeline adds shape functions no scheduler saw; they are
    built too, and the compile runs PyTorch's numbers at two sizes."""
    monkeypatch.setenv("TVMBRIDGE_COMPILE_THREADS", "2")
    monkeypatch.setenv("TVMBRIDGE_DISK_CACHE", "0")
    streamed: list[int] = []
    monkeypatch.setattr(codegen.KernelBuilder, "libraries", _counting(codegen.KernelBuilder.libraries, streamed))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    x = torch.randn(3, 8)
    module = add_tvm_dispatch(clone_module(model), (x,), dynamic={"input": {0: "batch"}})
    for n in (3, 5):
        x = torch.randn(n, 8)
        errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
        assert max(errs.values()) < 1e-5, errs
    assert [v.symbolic for v in dispatcher_of(module).variants] == [True] and streamed


def _counting(method, calls: list[int]):
    def counted(self):
        libs = method(self)
        calls.append(len(libs))
        return libs

    return counted


def _ir_size(exe: tvm.runtime.Executable) -> int:
    return sum(len(m.inspect_source("ll")) for m in exe.mod._collect_dso_modules())


def _checks(exe: tvm.runtime.Executable) -> int:
    """How many argument-check failures the kernels can raise (TVM's messages name the argument)."""
    return sum(m.inspect_source("ll").count("TVMFFIErrorSetRaisedFromCStrParts") for m in exe.mod._collect_dso_modules())


def test_the_callers_pass_context_holds_in_every_build_thread(layer_halves):
    """A caller's ``PassContext`` reaches the threads that build the kernels (it is thread-local
    in TVM): with TVM's own vectorization off the code differs in every group."""
    lowered = backend_build.lower(layer_halves, TARGET)
    pipeline = backend_build.after_lowering(TARGET)
    default = codegen.build_executable(lowered, TARGET, pipeline, threads=2)
    with tvm.transform.PassContext(config={"tirx.disable_vectorize": True}):
        serial = codegen.build_executable(lowered, TARGET, pipeline, threads=2)
    assert len(serial.mod._collect_dso_modules()) > 1
    assert _ir_size(serial) != _ir_size(default)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_leave_out_argument_checks_unless_asked(layer_halves, monkeypatch, threads):
    """By default TVM's per-kernel argument checks are left out (most of a small kernel's code);
    ``TVMBRIDGE_KERNEL_ASSERTS=1`` keeps them. Either way the VM checks the function's inputs."""
    lowered = backend_build.lower(layer_halves, TARGET)
    pipeline = backend_build.after_lowering(TARGET)
    monkeypatch.delenv("TVMBRIDGE_KERNEL_ASSERTS", raising=False)
    unchecked = codegen.build_executable(lowered, TARGET, pipeline, threads=threads)
    monkeypatch.setenv("TVMBRIDGE_KERNEL_ASSERTS", "1")
    checked = codegen.build_executable(lowered, TARGET, pipeline, threads=threads)
    assert _checks(checked) > 2 * _checks(unchecked)
    assert _ir_size(unchecked) < _ir_size(checked) / 2
    expected = _vm_outputs(checked, layer_halves)
    assert all(np.array_equal(a, b) for a, b in zip(expected, _vm_outputs(unchecked, layer_halves), strict=True))
    vm = relax.VirtualMachine(unchecked, tvm.cpu())
    func = layer_halves["forward_infer"]
    args = [tvm.runtime.tensor(np.zeros([int(d) for d in p.ty.shape.values], str(p.ty.dtype))) for p in func.params]
    wrong = np.zeros([int(d) + 1 for d in func.params[0].ty.shape.values], str(func.params[0].ty.dtype))
    with pytest.raises(Exception, match="match_cast|shape"):
        vm["forward_infer"](tvm.runtime.tensor(wrong), *args[1:])


def test_the_kernel_checks_setting_is_part_of_the_executable_key(layer_halves, monkeypatch):
    from tvmbridge.backend.executable_cache import cache_key

    monkeypatch.delenv("TVMBRIDGE_KERNEL_ASSERTS", raising=False)
    default = cache_key(layer_halves, TARGET, True, True, None)
    monkeypatch.setenv("TVMBRIDGE_KERNEL_ASSERTS", "1")
    assert cache_key(layer_halves, TARGET, True, True, None) != default


def test_compile_threads_setting(monkeypatch):
    monkeypatch.setenv("TVMBRIDGE_COMPILE_THREADS", "3")
    assert codegen.compile_threads() == 3
    monkeypatch.setenv("TVMBRIDGE_COMPILE_THREADS", "many")
    with pytest.raises(ValueError, match="TVMBRIDGE_COMPILE_THREADS"):
        codegen.compile_threads()
    monkeypatch.delenv("TVMBRIDGE_COMPILE_THREADS")
    assert codegen.compile_threads() >= 1


@pytest.mark.parametrize("threads", ["1", "2"])
def test_training_matches_pytorch_at_any_thread_count(threads, monkeypatch):
    monkeypatch.setenv("TVMBRIDGE_COMPILE_THREADS", threads)
    torch.manual_seed(0)
    model = bert_layer(small=True)
    reference = clone_module(model)
    add_tvm_dispatch(model, bert_inputs(hidden=64))
    errs = max_errors(run_step(model, bert_inputs(hidden=64)), run_step(reference, bert_inputs(hidden=64)))
    imports = [m.kind for m in dispatcher_of(model).variants[0].compiled.executable.mod.imports]
    library = threads == "2" or parallel_launch.launcher() is not None  # the launcher is set in a library
    assert imports == (["library"] if library else ["llvm"]), "a library on two threads, the JIT on one"
    assert max(errs.values()) < 1e-4, errs
    assert model._tvm_dispatch.calls_tvm == 1 and model._tvm_dispatch.calls_fallback == 0


def _legalized(mod: tvm.IRModule, memo: MemoizedLegalization | None) -> tvm.IRModule:
    table = memo.table() if memo is not None else backend_build._LEGALIZE_FIXES
    with TARGET:
        return relax.transform.LegalizeOps(table)(mod)


def test_memoized_legalization_makes_the_same_module(layer_halves):
    memo = MemoizedLegalization(backend_build._LEGALIZE_FIXES)
    assert tvm_ffi.structural_equal(_legalized(layer_halves, None), _legalized(layer_halves, memo))
    assert memo.hits > memo.misses, "forward, no-grad forward and backward repeat most calls"


def test_a_repeated_argument_is_part_of_the_memo_key():
    """``x + x`` and ``x + y`` have the same op and types; one's kernel call must not serve the
    other's arguments (nor ``y + x`` reuse ``x + y`` with the arguments swapped wrongly)."""
    t = relax.TensorType((4, 8), "float32")
    x, y = relax.Var("x", t), relax.Var("y", t)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(x, x))
            b = bb.emit(relax.op.add(x, y))
            c = bb.emit(relax.op.subtract(y, x))
            d = bb.emit(relax.op.subtract(x, y))
            out = bb.emit_output(relax.Tuple([a, b, c, d]))
        bb.emit_func_output(out)
    mod = bb.get()
    memo = MemoizedLegalization(backend_build._LEGALIZE_FIXES)
    legalized = _legalized(mod, memo)
    assert memo.hits == 1  # subtract(x, y) reuses subtract(y, x)'s kernel, on its own arguments
    exe = tvm.compile(legalized, target=TARGET)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    xv, yv = np.arange(32, dtype="float32").reshape(4, 8), np.full((4, 8), 5.0, "float32")
    got = [o.numpy() for o in vm["main"](tvm.runtime.tensor(xv), tvm.runtime.tensor(yv))]
    for g, want in zip(got, (xv + xv, xv + yv, yv - xv, xv - yv), strict=True):
        np.testing.assert_array_equal(g, want)


def test_a_size_the_legalization_defines_is_never_reused():
    """Two slices with data-dependent bounds have equal types but their own output sizes, which
    each legalization defines with a ``match_cast`` of its own: the second may not reuse the
    first's sizes."""
    t = relax.TensorType((6, 4), "float32")
    x, b1, b2 = relax.Var("x", t), relax.Var("b1", relax.TensorType((2,), "int64")), relax.Var(
        "b2", relax.TensorType((2,), "int64")
    )
    steps = relax.const([1, 1], "int64")
    bb = relax.BlockBuilder()
    with bb.function("main", [x, b1, b2]):
        with bb.dataflow():
            ends = relax.const([6, 4], "int64")
            a = bb.emit(relax.op.dynamic_strided_slice(x, b1, ends, steps))
            c = bb.emit(relax.op.dynamic_strided_slice(x, b2, ends, steps))
            out = bb.emit_output(relax.Tuple([a, c]))
        bb.emit_func_output(out)
    memo = MemoizedLegalization(backend_build._LEGALIZE_FIXES)
    legalized = _legalized(bb.get(), memo)
    assert memo.hits == 0
    assert tvm_ffi.structural_equal(legalized, _legalized(bb.get(), None))


def test_a_callers_pass_timing_sees_the_whole_build(layer_halves):
    """Under the caller's instruments the build runs in the caller's own context (as
    ``tvm.compile`` would): a timing instrument sees its passes and keeps its profile."""
    lowered = backend_build.lower(layer_halves, TARGET)
    pipeline = backend_build.after_lowering(TARGET)
    timing = tvm.ir.instrument.PassTimingInstrument()
    with tvm.transform.PassContext(instruments=[timing]):
        exe = codegen.build_executable(lowered, TARGET, pipeline, threads=2)
        profile = timing.render()
    assert "VMShapeLower" in profile and "LowerTVMBuiltin" in profile, profile[:500]
    assert _checks(exe) > 0  # that context's own code: TVM's checks kept



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_module_llvm_cannot_optimize_still_compiles(dtype):
    """LLVM's SLP vectorizer emits an invalid module for a row argmax built beside a sum over the
    same axis at some sizes ("Instruction does not dominate all uses": the compile failed); its
    kernels are then built one by one, at LLVM's opt level 1 where one still fails."""
    x = torch.randn(4, 2, 9, dtype=dtype)
    fn = lambda t: t.argmax(1).to(t.dtype) * t.sum(1)  # noqa: E731
    m = add_tvm_dispatch(Fn(fn), (x,), verify=False, disk_cache=False)
    got = m(x)
    assert "ran the compiled code" in dispatcher_of(m).explain()
    torch.testing.assert_close(got, fn(x), rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)


def test_a_kernel_llvm_cannot_optimize_is_built_at_opt_level_1(layer_halves, monkeypatch):
    kernels = _kernels(backend_build.lower(layer_halves, TARGET))
    group = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in kernels.items()})
    victim = sorted(gv.name_hint for gv in group.get_global_vars())[0]
    real_build, builds = codegen._tir_build, []

    def flaky_build(mod, target):
        names = [gv.name_hint for gv in mod.get_global_vars()]
        level = int(target.attrs.get("opt-level", 3))
        builds.append((len(names), level))
        if victim in names and level > 1:
            raise tvm.error.InternalError("LLVM module verification failed with the following errors:")
        return real_build(mod, target)

    monkeypatch.setattr(codegen, "_tir_build", flaky_build)
    lib = codegen.build_kernels(group, TARGET)
    assert builds[0] == (len(group.functions), 3)  # the group first, then each kernel alone
    assert [b for b in builds if b[1] == 1] == [(1, 1)]  # only the victim at opt level 1
    for gv in group.get_global_vars():
        assert lib.get_function(gv.name_hint, query_imports=True) is not None
