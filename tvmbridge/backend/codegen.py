"""Code generation for a lowered module, on every core the process may use.

``tvm.compile`` hands all of a module's kernels to LLVM as one module, and ``export_library``
emits its object code in one call: both run on one core, and on CPU they are most of a compile.
Kernels do not call one another, so on an ``llvm`` target the kernels are cut into groups of about
equal size, each group is built (TVM's TIR pipeline, LLVM's optimizer) and later emitted as object
code in a thread of its own (tvm-ffi releases the GIL inside both), and the groups are linked into
one library. The VM's bytecode and the kernels' code are those ``tvm.compile`` makes; only how
many LLVM modules hold the kernels differs. GPU targets keep ``tvm.compile`` and
``export_library`` as they are (a device module per group would need its own packing).

TVM's per-kernel argument checks are left out (:func:`kernel_asserts`): every kernel would check
every argument's dtype, rank, shape, strides and device on every call, and that checking code is
most of what LLVM compiles for a small kernel. The VM still checks each compiled function's own
inputs (rank, dtype, shape), the bridge passes only compact tensors at offset 0 (DLPack from
torch), and every other tensor a kernel sees is one the VM allocated with the shape the compile
proved, or the result of a library call (an offloaded GEMM or convolution, computed by PyTorch on
those tensors). A wrong shape from the compiler itself would no longer raise in the kernel:
``TVMBRIDGE_KERNEL_ASSERTS=1`` is the switch for hunting such a bug.

CUDA kernels are compiled with IEEE division and square root, no flush-to-zero and no FMA
contraction (:func:`exact_cuda_math`): TVM compiles CUDA with ``--use_fast_math``, which rounds
differently from eager's CUDA kernels in every one of those, as LLVM's contraction did on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import vm_build

from . import speculable_divisions

T = TypeVar("T")
R = TypeVar("R")

_WRITE_LOCK = threading.Lock()  # TVM's export of one executable from two threads at once crashes
_LLVM_INVALID = "LLVM module verification failed"
GROUPS_PER_THREAD = 3  # more groups than threads: a group of slow kernels does not leave a core idle


# what --use_fast_math implies, undone: NVRTC takes the later flag; the nvcc path has its own switch
EXACT_NVRTC_FLAGS = "--ftz=false --prec-div=true --prec-sqrt=true --fmad=false"
_NVRTC_OPTS, _NVCC_NO_FAST_MATH = "TVM_CUDA_NVRTC_EXTRA_OPTS", "TVM_CUDA_NVCC_NO_FAST_MATH"
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def exact_cuda_math() -> Iterator[None]:
    """TVM's CUDA compile callback (``tvm.support.nvcc``) without fast math, for the block: its
    environment switches set, and restored after (they are the process's, not the bridge's). One
    thing stays approximate under NVRTC: ``expf``/``logf`` as the fast intrinsics, which no flag
    after TVM's ``--use_fast_math`` undoes (float32 ``exp`` is ``fast_math``'s polynomial anyway)."""
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in (_NVRTC_OPTS, _NVCC_NO_FAST_MATH)}
        os.environ[_NVRTC_OPTS] = f"{saved[_NVRTC_OPTS] or ''} {EXACT_NVRTC_FLAGS}".strip()
        os.environ[_NVCC_NO_FAST_MATH] = "1"
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def kernel_asserts() -> bool:
    """Whether kernels keep TVM's argument checks: ``TVMBRIDGE_KERNEL_ASSERTS=1`` (a compiler bug
    hunt: a kernel given a tensor it was not compiled for then raises instead of reading past it),
    or under the caller's pass instruments (the build then runs in the caller's own context, as
    ``tvm.compile`` would: a second context holding the same instruments would enter and exit
    them again, and a timing instrument clears its profile on exit; the caller's own context is
    not entered again either). Part of the executable key."""
    if os.environ.get("TVMBRIDGE_KERNEL_ASSERTS", "").strip() not in ("", "0"):
        return True
    return bool(list(tvm.transform.PassContext.current().instruments))


# TVM's LoopPartition also peels constant-extent loops where a ``likely`` condition binds: the
# CPU schedules mark the partial last vector of a row so (``vector_tails.with_tail_predicates``);
# nothing else in the bridge's CPU kernels is marked likely (a GPU build keeps TVM's default)
LOOP_PARTITION = {"s_tir.LoopPartition": {"partition_const_loop": True}}


def _build_context(context: tvm.transform.PassContext, target: tvm.target.Target) -> tvm.transform.PassContext:
    """A pass context with the caller's opt level, required and disabled passes and config,
    :data:`LOOP_PARTITION` on a CPU, and TVM's kernel argument checks left out unless
    :func:`kernel_asserts` (a caller's own config setting wins); under the caller's pass
    instruments, the caller's context itself."""
    if list(context.instruments):  # the caller's own (see kernel_asserts)
        return context
    defaults: dict[str, Any] = dict(LOOP_PARTITION) if target.kind.name == "llvm" else {}
    if not kernel_asserts():
        defaults["tirx.disable_assert"] = True
    return tvm.transform.PassContext(
        opt_level=context.opt_level,
        required_pass=list(context.required_pass),
        disabled_pass=list(context.disabled_pass),
        config={**defaults, **dict(context.config)},
    )


def compile_threads() -> int:
    """Threads for code generation: ``TVMBRIDGE_COMPILE_THREADS``, else the cores this process
    may run on."""
    value = os.environ.get("TVMBRIDGE_COMPILE_THREADS", "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"TVMBRIDGE_COMPILE_THREADS={value!r} is not a number of threads") from None
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _in_threads(work: Callable[[T], R], items: Sequence[T], threads: int) -> list[R]:
    if threads <= 1 or len(items) <= 1:
        return [work(x) for x in items]
    with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="tvmbridge-codegen") as pool:
        return list(pool.map(work, items))


def _kernel_size(func: tvm.tirx.PrimFunc) -> int:
    """A kernel's size, for balancing groups: the length of its serialized TIR (what LLVM gets,
    before unrolling)."""
    return len(tvm.ir.save_json(func))


def tir_pipeline(target: tvm.target.Target) -> str:
    """The TIR pipeline kernels for ``target`` are built with: on a CPU, TVM's with divisions by
    run-time sizes taken out of loops (``speculable_divisions``: LLVM's vectorizer miscompiles
    them in a branch)."""
    return speculable_divisions.PIPELINE if target.kind.name == "llvm" else "default"


def _tir_build(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.runtime.Module:
    return tvm.tirx.build(mod, target=target, pipeline=tir_pipeline(target))


def build_kernels(group: tvm.IRModule, target: tvm.target.Target) -> tvm.runtime.Module:
    """``tvm.tirx.build(group, target)``; where LLVM's optimizer emits an invalid module (its SLP
    vectorizer, on some mixes of kernels: a row argmax beside a sum), each kernel is built alone,
    and one that still fails at LLVM's opt level 1 (no SLP vectorizer): a compile does not fail on
    LLVM's bug, and each kernel still computes what its TIR says."""
    try:
        return _tir_build(group, target)
    except Exception as exc:  # noqa: BLE001 - TVM raises its InternalError for LLVM's verifier
        if _LLVM_INVALID not in str(exc) or target.kind.name != "llvm":
            raise
    cautious = tvm.target.Target({**dict(target.export()), "opt-level": 1})
    libs = []
    for gv, func in group.functions_items():
        single = tvm.IRModule({gv: func}, attrs=group.attrs)
        try:
            libs.append(_tir_build(single, target))
        except Exception as exc:  # noqa: BLE001
            if _LLVM_INVALID not in str(exc):
                raise
            libs.append(_tir_build(single, cautious))
    for lib in libs[1:]:
        libs[0].import_module(lib)
    return libs[0]


def kernel_groups(tir: tvm.IRModule, groups: int) -> list[tvm.IRModule]:
    """The module's kernels in at most ``groups`` modules of about equal size (largest first, each
    to the smallest group so far), in descending order of size (the slowest starts first)."""
    sized = sorted(((_kernel_size(f), gv) for gv, f in tir.functions_items()), key=lambda x: (-x[0], x[1].name_hint))
    bins: list[tuple[int, list[tvm.ir.GlobalVar]]] = [(0, []) for _ in range(max(1, min(groups, len(sized))))]
    for size, gv in sized:
        i = min(range(len(bins)), key=lambda j: bins[j][0])
        bins[i] = (bins[i][0] + size, [*bins[i][1], gv])
    bins.sort(key=lambda b: -b[0])
    return [tvm.IRModule({gv: tir[gv] for gv in members}, attrs=tir.attrs) for _, members in bins if members]


class KernelBuilder:
    """Kernels built (TVM's TIR pipeline and LLVM's optimizer) in background threads as they
    become final, ``per_group`` to a module, while the caller schedules the next ones and lowers
    the Relax functions: on a CPU build, scheduling runs in Python and LLVM outside the GIL, so the
    two overlap. :func:`build_executable` takes the libraries, and builds anything the Relax
    pipeline added or changed itself."""

    def __init__(self, target: tvm.target.Target, threads: int, per_group: int = 8) -> None:
        self.target = target
        self.context = _build_context(tvm.transform.PassContext.current(), target)
        self.per_group = per_group
        self.kernels: dict[str, tvm.tirx.PrimFunc] = {}
        self._group: dict[tvm.ir.GlobalVar, tvm.tirx.PrimFunc] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tvmbridge-codegen")
        self._built: list[Future] = []

    def add(self, gv: tvm.ir.GlobalVar, func: tvm.tirx.PrimFunc) -> None:
        """A kernel in its final form (the name it is called by becomes its symbol)."""
        func = func.with_attr("global_symbol", gv.name_hint)
        self.kernels[gv.name_hint] = func
        self._group[gv] = func
        if len(self._group) >= self.per_group:
            self._submit()

    def _submit(self) -> None:
        if self._group:
            group, self._group = tvm.IRModule(self._group), {}
            self._built.append(self._pool.submit(self._build, group))

    def _build(self, group: tvm.IRModule) -> tvm.runtime.Module:
        with self.context:
            return build_kernels(group, self.target)

    def libraries(self) -> list[tvm.runtime.Module]:
        """Every kernel's library, once all are built (a build's error raises here)."""
        self._submit()
        try:
            return [f.result() for f in self._built]
        finally:
            self._pool.shutdown()

    def cancel(self) -> None:
        """Nothing more is built (what runs finishes)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def build_executable(
    lowered: tvm.IRModule,
    target: tvm.target.Target,
    relax_pipeline: tvm.transform.Pass,
    threads: int | None = None,
    prebuilt: KernelBuilder | None = None,
) -> tvm.runtime.Executable:
    """What ``tvm.compile(lowered, target, relax_pipeline=...)`` makes, with the kernels built in
    ``threads`` threads (default :func:`compile_threads`) on an ``llvm`` target. The caller's
    ``PassContext`` (options, disabled passes) holds in every thread; under pass instruments
    (which see passes in order) the kernels are built in this thread. ``prebuilt``: the kernels
    of ``lowered`` already being built; only what the Relax pipeline adds is built here (and
    everything again, should the pipeline have changed one of them)."""
    threads = compile_threads() if threads is None else threads
    caller = tvm.transform.PassContext.current()
    context = _build_context(caller, target)
    here = contextlib.nullcontext() if context.same_as(caller) else context  # entered once, not again
    if prebuilt is not None and (target.kind.name != "llvm" or threads <= 1 or list(context.instruments)):
        prebuilt.cancel()  # the caller's builder is for a plain llvm build only
        prebuilt = None
    if target.kind.name == "cuda":
        with here, exact_cuda_math():
            return tvm.compile(lowered, target=target, relax_pipeline=relax_pipeline)
    # on one thread too: the kernels in groups, each through build_kernels (LLVM's verifier failures)
    if target.kind.name != "llvm" or list(context.instruments):
        with here:
            return tvm.compile(lowered, target=target, relax_pipeline=relax_pipeline, tir_pipeline=tir_pipeline(target))
    with target:
        mod = relax_pipeline(lowered)
    attrs = dict(mod.attrs) if mod.attrs else {}
    params = dict(attrs.get("const_name_to_constant", {}))
    ext_libs = list(attrs.get("external_mods", []))
    builder = relax.ExecBuilder()
    tir = vm_build._filter_tir(vm_build._vmcodegen(builder, mod))
    system_lib = tir is not None and (
        tir.get_attr("system_lib_prefix") is not None or vm_build._auto_attach_system_lib_prefix(tir, target) is not tir
    )
    if tir is None or ext_libs or system_lib:  # what relax.build links in a way this path does not
        if prebuilt is not None:
            prebuilt.cancel()
        with here:
            return vm_build._vmlink(builder, target, tir, tir_pipeline(target), ext_libs=ext_libs, params=params)

    def build(group: tvm.IRModule) -> tvm.runtime.Module:
        with context:
            return build_kernels(group, target)

    libs = prebuilt.libraries() if prebuilt is not None else []
    if prebuilt is not None:
        built = prebuilt.kernels
        rest = {gv: f for gv, f in tir.functions_items() if gv.name_hint not in built}  # the pipeline's own
        if any(
            not tvm_ffi.structural_equal(built[gv.name_hint], f) for gv, f in tir.functions_items() if gv not in rest
        ):
            libs, rest = [], dict(tir.functions_items())  # the pipeline rewrote a kernel built already: all again
        tir = tvm.IRModule(rest, attrs=tir.attrs)
    if len(tir.functions):
        groups = threads * GROUPS_PER_THREAD if threads > 1 else 1  # one thread: one module, as tvm.compile
        libs += _in_threads(build, kernel_groups(tir, groups), threads)
    for lib in libs[1:]:  # one import tree: the VM finds a kernel in any of them
        libs[0].import_module(lib)
    return relax.VMExecutable(vm_build._ffi_api.VMLink(builder, target, libs[0], [], params))


def write_library(exe: tvm.runtime.Executable, path: str, threads: int | None = None) -> None:
    """``exe.export_library(path)``, the LLVM modules' object code emitted in ``threads`` threads.
    Anything but plain LLVM modules (a GPU's device code, a system library) goes through
    ``export_library`` itself."""
    with _WRITE_LOCK:
        _write_library(exe, path, compile_threads() if threads is None else threads)


def _write_library(exe: tvm.runtime.Executable, path: str, threads: int) -> None:
    root = exe.mod
    dso = root._collect_dso_modules()
    plain = all(m.kind == "llvm" and not m.get_function("__tvm_is_system_module")() for m in dso)
    if threads <= 1 or len(dso) <= 1 or not plain:
        exe.export_library(path)
        return
    from tvm.runtime import _ffi_api
    from tvm.support import cc

    with tempfile.TemporaryDirectory(prefix="tvmbridge-link-") as work:
        objects = [os.path.join(work, f"lib{i}.o") for i in range(len(dso))]
        _in_threads(lambda pair: pair[0].write_to_file(pair[1]), list(zip(dso, objects)), threads)
        files = list(objects)
        if root.imports:  # the VM's bytecode (and constants), as export_library packs them
            llvm_target = dso[0].get_function("_get_target_string")()
            packed = _ffi_api.ModulePackImportsToLLVM(root, False, llvm_target, "")
            files.append(os.path.join(work, "devc.o"))
            packed.write_to_file(files[-1])
        cc.create_shared(path, files)
