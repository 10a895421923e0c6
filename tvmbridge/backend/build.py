"""Lower and compile a Relax module for its target, and load it in a VM.

The pipeline is TVM's for the target (``relax.backend.<kind>.pipeline``) with its legalize stage
replaced by the bridge's (:func:`lower`): TVM's ``LegalizeOps`` with three fixes, operator fusion,
and on CPU the bridge's schedules (``cpu_schedules``), on GPU dlight's (untuned GPU kernels are not
even valid). Builds go through the disk cache of executables (``executable_cache``).
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import tvm
import tvm_ffi
from tvm import relax, te

from .. import parallel_launch
from ..caches import CACHES
from ..devices import prepare_cpu_runtime, rounds_every_op, tvm_device
from ..errors import stage_errors
from ..ir import RewriteBindings, is_op, static_shape
from ..kernels.barrier import drop_barriers, register_barrier
from ..kernels.conv import register_convs
from ..kernels.gemm import register_gemms
from . import codegen, executable_cache
from .cast_per_consumer import CastPerConsumer
from .fresh_results import fresh_constant_results
from .fusion_bounds import bound_fusion_search
from .legalize_memo import MemoizedLegalization
from .shared_kernels import ShareKernelsAcrossShapes


def _legalize_full(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``full``/``full_like`` with a non-finite fill (``-inf`` masks): TVM 0.27's ``topi.full``
    tests ``"float" in dtype`` on a dtype object and raises, so such fills are written as a
    compute of the constant; every other call keeps TVM's own legalization."""
    fill = call.args[1]
    if isinstance(fill, tvm.ir.expr.Constant) and fill.value.numpy().size == 1:
        value = float(fill.value.numpy().reshape(()))
        if not math.isfinite(value):
            dtype = str(call.ty.dtype)
            shape = call.ty.shape.values
            return bb.call_te(
                lambda: te.compute(shape, lambda *_: tvm.tirx.const(value, dtype)), primfunc_name_hint="full"
            )
    return call.op.get_attr("FLegalize")(bb, call)


def _non_finite_fill_constant(value: relax.Expr, bound: dict) -> relax.Expr | None:
    """``full(static shape, -inf)`` as the constant it is, for passes that evaluate ops with
    TVM's own legalization (``FoldConstant``), which hits the ``topi.full`` bug above."""
    if not (is_op(value, "relax.full") and isinstance(value.args[1], tvm.ir.expr.Constant)):
        return None
    fill = value.args[1].value.numpy()
    shape = static_shape(value)
    if fill.size != 1 or shape is None or np.isfinite(fill).all():
        return None
    return relax.const(np.full(shape, fill.reshape(()), dtype=str(value.ty.dtype)), str(value.ty.dtype))


def materialize_non_finite_fills() -> tvm.transform.Pass:
    """Every static ``full`` with a non-finite fill becomes a constant."""
    return tvm.transform.module_pass(
        RewriteBindings([_non_finite_fill_constant]).transform_module,
        opt_level=0,
        name="tvmbridge.MaterializeNonFiniteFills",
    )


def _legalize_take_clipped(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``take`` in Relax's default ``"fast"`` mode (TVM's frontend converts ``x[idx]``,
    ``index_select`` ... so) reads an index out of range unchecked, a segfault, and TOPI logs
    "Fast mode segfaults when there are out-of-bounds indices" to stderr for every one it builds.
    Clipped instead: the same reads for every index in range, never a read outside the tensor
    (where the bridge checks the indices, ``x[idx]`` and embeddings, its range flag still raises
    after the call on one out of range)."""
    if str(call.attrs.mode) == "fast":
        call = relax.op.take(call.args[0], call.args[1], call.attrs.axis, mode="clip")
    return call.op.get_attr("FLegalize")(bb, call)


# keyed by op name, as LegalizeOps takes it; read-only
_LEGALIZE_FIXES = {
    "relax.full": _legalize_full,
    "relax.full_like": _legalize_full,
    "relax.take": _legalize_take_clipped,
}


def _without_scope_pragma(stmt: tvm.tirx.AttrStmt) -> tvm.tirx.Stmt:
    return stmt.body if stmt.attr_key == "pragma_scope" else stmt


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.DropScopePragmas")
def drop_scope_pragmas(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """TOPI's hand-written kernels (``scatter_nd``, ``scatter_elements``, ``index_put``,
    ``take_backward``: embedding and cross-entropy gradients) wrap their loops in the
    ``pragma_scope`` attribute of ``T.seq_scope()``, which only groups statements while they are
    built; LLVM's code generator knows no such pragma and logs "Unknown pragma pragma_scope" for
    each. The attribute is dropped, its body kept."""
    out = mod.clone()
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            new = tvm_ffi.structural_map(func, [(tvm.tirx.AttrStmt, _without_scope_pragma)])
            if not new.same_as(func):
                out[gv] = new
    return out


def lower(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    schedule: bool = True,
    fuse: bool = True,
    tuning_db: str | None = None,
    on_kernel: Callable[[tvm.ir.GlobalVar, tvm.tirx.PrimFunc], None] | None = None,
) -> tvm.IRModule:
    """The bridge's Relax pipeline up to (not including) code generation. ``schedule=False``
    leaves TVM's own CPU kernels unscheduled (serial loops), ``fuse=False`` keeps one kernel per
    Relax op: both for measuring what each buys. ``tuning_db``: a MetaSchedule work directory
    whose best records replace the default schedules of the kernels they cover. ``on_kernel``
    (CPU): told each kernel in its final form as soon as it is scheduled."""
    seq = [drop_barriers] if rounds_every_op(target) else []  # nothing to contract: nothing to keep apart
    seq += [
        # a dead binding (a rounding Float32Opmath elided: the bfloat16 copy of a float32 value
        # the next op reads in float32) is a consumer to FuseOps: its producer was written out
        # instead of fused into the op that reads it (a bfloat16 GELU's erf, exp, adds alone)
        relax.transform.DeadCodeElimination(),
        *([CastPerConsumer] if fuse else []),  # a cast read by several kernels: computed in each
        relax.transform.DeadCodeElimination(),
        relax.transform.LegalizeOps(MemoizedLegalization(_LEGALIZE_FIXES).table()),
        drop_scope_pragmas,
        fresh_constant_results,  # a constant result would be the VM's own memory, the same every call
        relax.transform.AnnotateTIROpPattern(),
    ]
    if fuse:
        seq += [bound_fusion_search, relax.transform.FuseOps(), relax.transform.FuseTIR()]
    seq.append(relax.transform.DeadCodeElimination())
    if fuse and target.kind.name == "llvm":
        seq.append(ShareKernelsAcrossShapes())
    with target:
        mod = tvm.ir.transform.Sequential(seq)(mod)
    if tuning_db is not None and schedule:
        mod = _apply_tuning(mod, target, tuning_db)
    with target:
        if target.kind.name == "llvm" and schedule:
            from .cpu_schedules import apply_cpu_schedules

            mod = apply_cpu_schedules(mod, target, on_kernel)
        if target.kind.name in ("cuda", "rocm") and schedule:  # unscheduled: for kernel_check only
            from .gpu_schedules import apply_gpu_schedules

            mod = apply_gpu_schedules(mod, target)
    return mod


def _target_backend(target: tvm.target.Target) -> Any:
    """TVM's per-target pipeline module (``relax.backend.<kind>.pipeline``: its pass lists)."""
    import importlib

    kind = {"llvm": "cpu_generic", "cuda": "cuda", "rocm": "rocm"}.get(target.kind.name, "gpu_generic")
    return importlib.import_module(f"tvm.relax.backend.{kind}.pipeline")  # the package exports three of the four


def after_lowering(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's default pipeline for ``target`` without its legalize stage, which :func:`lower`
    replaces: library dispatch, dataflow lowering and the VM's finalization as TVM lists them.
    Left out with that stage is TVM's ``FoldConstant``, which builds and runs every kernel whose
    inputs are all constants at compile time (a ``full``, an ``arange`` mask), each a separate
    LLVM build: most of the lowering time of a small model, to save kernels of a few microseconds."""
    b = _target_backend(target)
    passes = b.library_dispatch_passes(target) + b.dataflow_lower_passes(target) + b.finalize_passes(target)

    @tvm.transform.module_pass(opt_level=0, name="tvmbridge.AfterLowering")
    def pipeline(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return pipeline


def _apply_tuning(mod: tvm.IRModule, target: tvm.target.Target, tuning_db: str) -> tvm.IRModule:
    """The database's records for this target applied; any failure to read or apply them is a
    warning and the default schedules, never an error from inside TVM."""
    from .tuning import apply_database

    try:
        if (records := _records_for(str(tuning_db), target)) is None:
            return mod
        usable, foreign = records
        tuned, missing = apply_database(mod, target, usable)
    except Exception as exc:  # noqa: BLE001 - a record TVM cannot replay: defaults, said once
        _note_tuning(
            f"tvmbridge: the tuning database {tuning_db} could not be applied "
            f"({_error_summary(exc)}); using the default schedules"
        )
        return mod
    if foreign:
        _note_tuning(
            f"tvmbridge: the tuning database {tuning_db} holds records for another target "
            f"({'; '.join(foreign)[:300]}), not {target}; they are ignored (tune on this machine: "
            "tvmbridge tune)"
        )
    if missing:
        kernels = sum(isinstance(f, tvm.tirx.PrimFunc) for f in tuned.functions.values())
        _note_tuning(
            f"tvmbridge: {len(missing)} of {kernels} kernels have no record in the tuning database "
            f"{tuning_db}; they keep the default schedule (tune this module: tvmbridge tune)"
        )
    return tuned


def tuning_state(tuning_db: str) -> tuple[str, tuple]:
    """The database's path and its files' (mtime, size): a changed database is another state."""
    from .tuning import DATABASE_FILES

    paths = [os.path.join(tuning_db, f) for f in DATABASE_FILES]
    stamp = tuple((os.stat(p).st_mtime_ns, os.stat(p).st_size) if os.path.isfile(p) else None for p in paths)
    return os.path.abspath(tuning_db), stamp


def _records_for(tuning_db: str, target: tvm.target.Target) -> tuple[Any, list[str]] | None:
    """The database's records for ``target`` (``tuning.records_for``), read once per state of its
    files: every variant a dispatch compiles would otherwise parse the whole database again."""
    from .tuning import open_database, records_for

    key = (*tuning_state(tuning_db), str(target))

    def read() -> tuple[Any, list[str]] | None:
        database = open_database(tuning_db)
        return None if database is None else records_for(database, target)

    return CACHES.tuning_records.get_or_make(key, read)  # (database, state of its files, target) -> records


def _error_summary(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:200]


@functools.cache
def _note_tuning(message: str) -> None:
    """Said once per message: what a tuning database did not cover, or could not do."""
    warnings.warn(message, stacklevel=5)


def caches_executables(disk_cache: bool) -> bool:
    """Whether a build with ``disk_cache`` goes through the executable cache."""
    return disk_cache and executable_cache.enabled()


def compile_or_load(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    schedule: bool = True,
    fuse: bool = True,
    tuning_db: str | None = None,
    disk_cache: bool = True,
    key: str = "",
) -> tuple[tvm.runtime.Executable, bool, str]:
    """:func:`compile_module` through the disk cache (``executable_cache``; with ``disk_cache``
    and unless the environment turns it off); whether the executable was loaded, and its key
    (``key``: the one an earlier compile of this very module computed, else computed now).

    A key not yet known is the digest of the module's JSON, which takes a while on a large model:
    it is computed in another thread while the module is lowered (TVM serializes outside the GIL),
    and the cache is looked up once both are done, before code generation."""
    if not caches_executables(disk_cache):
        return _as_library(compile_module(mod, target, schedule, fuse, tuning_db), target), False, ""
    cache = executable_cache.ExecutableCache()
    if key:
        exe, loaded = executable_cache.cached_compile(
            key, lambda: compile_module(mod, target, schedule, fuse, tuning_db), cache
        )
        return exe, loaded, key
    with ThreadPoolExecutor(1, thread_name_prefix="tvmbridge-cache-key") as pool:
        pending = pool.submit(executable_key(mod, target, schedule, fuse, tuning_db))
        exe, loaded = _compile(mod, target, schedule, fuse, tuning_db, lambda: cache.load(pending.result()))
        key = pending.result()
    if loaded:
        return exe, True, key
    return executable_cache.stored(key, exe, cache), False, key


def executable_key(
    mod: tvm.IRModule, target: tvm.target.Target, schedule: bool, fuse: bool, tuning_db: str | None
) -> Callable[[], str]:
    """What computes ``mod``'s key in the disk cache, in any thread: the build's settings read
    here, in the caller's thread (its pass context says whether kernels keep their checks)."""
    state = tuning_state(tuning_db) if tuning_db is not None and schedule else None
    asserts = codegen.kernel_asserts()
    return functools.partial(executable_cache.cache_key, mod, target, schedule, fuse, state, asserts)


def compile_module(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    schedule: bool = True,
    fuse: bool = True,
    tuning_db: str | None = None,
) -> tvm.runtime.Executable:
    """Lower and compile; a tuned schedule that does not compile leaves the database out (with
    a warning) rather than failing the compile."""
    return _compile(mod, target, schedule, fuse, tuning_db)[0]


def _compile(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    schedule: bool,
    fuse: bool,
    tuning_db: str | None,
    cached: Callable[[], tvm.runtime.Executable | None] = lambda: None,
) -> tuple[tvm.runtime.Executable, bool]:
    """:func:`compile_module`, asking ``cached`` for a stored executable once the module is
    lowered (code generation is most of a CPU build); and whether that one is returned."""

    def build(tuning: str | None) -> tuple[tvm.runtime.Executable, bool]:
        kernels = _kernel_builder(target, schedule)
        try:
            lowered = lower(mod, target, schedule, fuse, tuning, kernels.add if kernels else None)
            found = cached()
            if found is not None:
                return found, True
            return _codegen(lowered, target, kernels), False
        finally:
            if kernels is not None:
                kernels.cancel()  # a no-op once the executable has its libraries; else builds stop

    with stage_errors("build", what=f"compiling for {target.kind.name} failed"):
        if tuning_db is not None and schedule:
            try:
                return build(tuning_db)
            except Exception as exc:  # noqa: BLE001 - a record that replays but does not compile here
                _note_tuning(
                    f"tvmbridge: compiling with the tuning database {tuning_db} failed "
                    f"({_error_summary(exc)}); compiled with the default schedules instead"
                )
        return build(None)


def _codegen(
    lowered: tvm.IRModule, target: tvm.target.Target, prebuilt: codegen.KernelBuilder | None = None
) -> tvm.runtime.Executable:
    return codegen.build_executable(lowered, target, after_lowering(target), prebuilt=prebuilt)


def _kernel_builder(target: tvm.target.Target, schedule: bool) -> codegen.KernelBuilder | None:
    """A builder that compiles CPU kernels while the rest are scheduled (where the build uses
    more than one thread and no pass instrument watches it), else None."""
    threads = codegen.compile_threads()
    if target.kind.name != "llvm" or not schedule or threads <= 1 or codegen.kernel_asserts():
        return None
    return codegen.KernelBuilder(target, threads)


def _as_library(exe: tvm.runtime.Executable, target: tvm.target.Target) -> tvm.runtime.Executable:
    """A CPU executable as a shared library loaded from a temporary file: its object code emitted
    on every core (``codegen.write_library``), where the in-memory one would be compiled by LLVM's
    JIT on one core when its first VM is made. Where no library can be written (no C compiler),
    the in-memory executable."""
    if target.kind.name != "llvm" or (codegen.compile_threads() <= 1 and parallel_launch.launcher() is None):
        return exe
    with tempfile.TemporaryDirectory(prefix="tvmbridge-") as work:
        path = os.path.join(work, "executable.so")
        try:
            codegen.write_library(exe, path)
            return relax.VMExecutable(parallel_launch.load_library(path))  # mapped: the file may go
        except Exception as exc:  # noqa: BLE001 - the in-memory executable is the same code
            _note_library(
                f"tvmbridge: could not link the compiled code as a library ({_error_summary(exc)}); "
                "the executable runs through LLVM's JIT instead (slower to load, the same code)"
            )
            return exe


@functools.cache
def _note_library(message: str) -> None:
    warnings.warn(message, stacklevel=6)


def load(executable: tvm.runtime.Executable, device: torch.device) -> relax.VirtualMachine:
    register_barrier()  # the packed functions the compiled code may call
    register_gemms()
    register_convs()
    if device.type == "cpu":
        prepare_cpu_runtime()
    return relax.VirtualMachine(executable, tvm_device(device))


def release_cached_memory() -> None:
    """Free the buffers TVM's pooled allocators keep for reuse (every device, every VM) and give
    the freed pages back to the OS (glibc's ``malloc_trim``). The pool keys buffers by exact size,
    so a symbolic variant called at ever new sizes would only grow it; buffers in use are not
    touched."""
    tvm.get_global_func("vm.builtin.memory_manager.clear")()
    _malloc_trim()


@functools.cache
def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _malloc_trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
