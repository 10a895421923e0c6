"""TVM's CPU kernels' parallel loops on PyTorch's OpenMP threads, not on TVM's own thread pool.

A compiled step alternates between PyTorch's GEMMs (oneDNN/MKL on PyTorch's OpenMP threads) and
TVM's kernels. On TVM's own pool the two fight: after each GEMM PyTorch's OpenMP workers spin for
a while waiting for the next one, on the very cores TVM's workers then need, so a parallel TVM
kernel right after a GEMM ran no faster on two threads than on one; and TVM's pool takes half the
logical CPUs on x86, one core of two on a machine without SMT. Inductor's CPU kernels avoid both
by being OpenMP loops themselves. The bridge does the same: every library it compiles calls its
parallel loops through a pointer (``__TVMBackendParallelLaunch``) that TVM's runtime sets when it
loads the library, and the bridge points it (in its own libraries only) at a small launcher built
against PyTorch's own OpenMP runtime, which runs the loop's tasks in an ``omp parallel`` region
on ``omp_get_max_threads()`` threads: the threads, and the count, PyTorch's own parallel ops use
in that thread (``torch.set_num_threads`` included).

The launcher is C, compiled once per machine by the C compiler TVM's ``export_library`` uses too
(kept in the disk cache), linked against the OpenMP library PyTorch has loaded; it is used only
where it proves, once per process, to call that very library (not a second OpenMP runtime) and to
run each task once. Anything else (no compiler, PyTorch without OpenMP, ``TVMBRIDGE_OPENMP=0``)
leaves TVM's pool in charge, as before; :func:`status` says which and why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import tvm

from .disk_cache import DiskCache, cache_dir, enabled

SOURCE = r"""
#include <omp.h>
#include <stdint.h>
typedef struct { void* sync_handle; int32_t num_task; } TVMParallelGroupEnv;
typedef int (*FTVMParallelLambda)(int task_id, TVMParallelGroupEnv* penv, void* cdata);
static int64_t launches = 0;

int tvmbridge_parallel_launch(FTVMParallelLambda flambda, void* cdata, int num_task) {
  int n = num_task > 0 ? num_task : omp_get_max_threads();
  __atomic_add_fetch(&launches, 1, __ATOMIC_RELAXED);
  if (n <= 1 || omp_in_parallel()) {
    TVMParallelGroupEnv env = {0, 1};
    return flambda(0, &env, cdata);
  }
  int failed = 0;
#pragma omp parallel num_threads(n)
  {
    TVMParallelGroupEnv env = {0, omp_get_num_threads()};
    if (flambda(omp_get_thread_num(), &env, cdata) != 0) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed ? -1 : 0;
}

int tvmbridge_parallel_barrier(int task_id, TVMParallelGroupEnv* penv) {
#pragma omp barrier
  return 0;
}

int64_t tvmbridge_launches(void) { return __atomic_load_n(&launches, __ATOMIC_RELAXED); }
void* tvmbridge_omp_entry(void) { return (void*)&omp_get_max_threads; }
"""

_POINTERS = {
    "__TVMBackendParallelLaunch": "tvmbridge_parallel_launch",
    "__TVMBackendParallelBarrier": "tvmbridge_parallel_barrier",
}
_OMP_NAME = re.compile(r"^lib(gomp|iomp5|omp)([-.][^/]*)?\.so(\.\d+)*$")
_LAMBDA = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class Launcher:
    """The loaded launcher library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.lib.tvmbridge_launches.restype = ctypes.c_int64
        self.lib.tvmbridge_omp_entry.restype = ctypes.c_void_p
        self.lib.tvmbridge_parallel_launch.argtypes = [_LAMBDA, ctypes.c_void_p, ctypes.c_int]

    def address(self, symbol: str) -> int:
        return int(ctypes.cast(getattr(self.lib, symbol), ctypes.c_void_p).value or 0)

    def launches(self) -> int:
        """Parallel loops launched so far in this process (any library, any thread)."""
        return int(self.lib.tvmbridge_launches())

    def run_tasks(self, num_task: int = 0, fail_task: int | None = None) -> tuple[int, list[tuple[int, int]]]:
        """Launch a loop whose tasks record ``(task_id, num_task)``: the launch's result and the
        records (the self-test's and the tests' probe)."""
        seen: list[tuple[int, int]] = []
        lock = threading.Lock()

        def task(task_id: int, penv: int, _cdata: int) -> int:
            with lock:
                seen.append(
                    (task_id, ctypes.cast(penv + ctypes.sizeof(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int32))[0])
                )
            return -1 if task_id == fail_task else 0

        result = self.lib.tvmbridge_parallel_launch(_LAMBDA(task), None, num_task)
        return int(result), sorted(seen)


def openmp_runtime() -> Path | None:
    """The OpenMP library PyTorch has loaded (its own copy first), else None."""
    torch_dir = Path(torch.__file__).resolve().parent
    found: list[Path] = []
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = Path(line.split(maxsplit=5)[-1]) if len(line.split()) >= 6 else None
            if path is not None and _OMP_NAME.match(path.name) and path not in found:
                found.append(path)
    except OSError:
        return None
    torch_libs = (torch_dir, torch_dir.with_name("torch.libs"))  # its own copy, or the wheel's vendored one
    own = [p for p in found if any(d in p.resolve().parents for d in torch_libs)]
    candidates = own or found
    return candidates[0] if candidates else None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(path: str, omp: Path, compiler: str) -> None:
    """The launcher compiled and linked against ``omp`` itself (not the compiler's own OpenMP
    library: a second OpenMP runtime would start a second set of threads)."""
    with tempfile.TemporaryDirectory(prefix="tvmbridge-omp-") as work:
        src, obj = os.path.join(work, "launch.c"), os.path.join(work, "launch.o")
        Path(src).write_text(SOURCE)
        subprocess.run([compiler, "-O2", "-fPIC", "-fopenmp", "-c", src, "-o", obj], check=True, capture_output=True)
        link = [compiler, "-shared", obj, str(omp), f"-Wl,-rpath,{omp.parent}", "-o", path]
        subprocess.run(link, check=True, capture_output=True)


def _load(path: Path) -> Launcher:
    return Launcher(ctypes.CDLL(str(path)))


def _verified(launcher: Launcher, omp: Path) -> Launcher:
    """``launcher``, once it proves to call PyTorch's OpenMP library and to run every task of a
    loop once (raising otherwise)."""
    torch_omp = ctypes.CDLL(str(omp), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    expected = ctypes.cast(torch_omp.omp_get_max_threads, ctypes.c_void_p).value
    if launcher.lib.tvmbridge_omp_entry() != expected:
        raise RuntimeError(f"the launcher does not call {omp} (a second OpenMP runtime)")
    for asked in (0, 3):  # as many tasks as threads (what TVM's kernels ask), and a number
        result, seen = launcher.run_tasks(asked)
        n = len(seen)
        if result != 0 or n < 1 or (asked and n != asked) or seen != [(t, n) for t in range(n)]:
            raise RuntimeError(f"a test loop of {asked or 'all'} tasks ran as {seen} (result {result})")
    if launcher.run_tasks(2, fail_task=1)[0] == 0:
        raise RuntimeError("a failing task's error was lost")
    return launcher


def launcher() -> Launcher | None:
    """The OpenMP launcher of this process, or None where TVM's own pool runs the loops (the
    reason in :func:`status`)."""
    return resolve()[1]


def status() -> str:
    """Where TVM's parallel loops run: ``PyTorch's OpenMP threads (<library>)``, or ``TVM's pool
    (<why>)``."""
    return resolve()[0]


@functools.cache
def resolve() -> tuple[str, Launcher | None]:
    """Where this process runs TVM's parallel loops, and the launcher where it is PyTorch's
    threads (built, or read from the disk cache, and verified once per process)."""
    if os.environ.get("TVMBRIDGE_OPENMP", "1").strip().lower() in ("0", "false", "no", "off"):
        return "TVM's pool (TVMBRIDGE_OPENMP=0)", None
    if "OpenMP" not in torch.__config__.parallel_info():
        return "TVM's pool (PyTorch's parallel backend is not OpenMP)", None
    omp, compiler = openmp_runtime(), _compiler()
    if omp is None or compiler is None:
        return f"TVM's pool ({'no OpenMP library loaded' if omp is None else 'no C compiler (cc)'})", None
    h = hashlib.sha256(SOURCE.encode())
    h.update(f"{omp.resolve()}:{omp.stat().st_size}:{compiler}".encode())
    try:
        if enabled():
            cache: DiskCache[Launcher] = DiskCache(
                cache_dir() / "openmp", ".so", lambda _, p: _build(p, omp, compiler), _load, "OpenMP launcher"
            )
            found = cache.load(h.hexdigest())
            if found is None and cache.store(h.hexdigest(), None):  # type: ignore[arg-type]
                found = cache.load(h.hexdigest())
            if found is not None:
                return f"PyTorch's OpenMP threads ({omp.name})", _verified(found, omp)
        with tempfile.TemporaryDirectory(prefix="tvmbridge-omp-") as work:  # no cache: built for this process
            path = Path(work) / "launch.so"
            _build(str(path), omp, compiler)
            return f"PyTorch's OpenMP threads ({omp.name})", _verified(_load(path), omp)
    except Exception as exc:  # noqa: BLE001 - TVM's pool runs the loops, as without a launcher
        return (
            f"TVM's pool (no launcher: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})",
            None,
        )


def load_library(path: str | os.PathLike) -> tvm.runtime.Module:
    """``tvm.runtime.load_module(path)`` of a library the bridge built, its parallel loops on the
    OpenMP launcher where there is one."""
    module = tvm.runtime.load_module(str(path))
    install(path)
    return module


def install(path: str | os.PathLike) -> bool:
    """Point the parallel-loop launch of the library loaded from ``path`` (one the bridge built)
    at the OpenMP launcher; False where there is none, or the library has no parallel loop."""
    found = launcher()
    if found is None:
        return False
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    done = False
    for pointer, symbol in _POINTERS.items():
        try:
            ctypes.c_void_p.in_dll(lib, pointer).value = found.address(symbol)
            done = True
        except ValueError:  # no such loop in this library
            continue
    return done
