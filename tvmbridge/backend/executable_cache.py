"""Compiled executables kept on disk, so that a new process with the same model loads instead of
compiling (as inductor's FX graph cache does for torch.compile).

Content-addressed: the key is a digest of everything the build reads: the Relax module it lowers
(its JSON), the target, the schedule options, the tuning database's state, the machine (CPU model,
ISA flags, threads) and the versions of TVM, tvm-ffi, torch and the bridge's own source. Equal keys
compile to the same code, so an entry is never stale: a changed pass, option or library is another
key. An entry is the shared library ``export_library`` writes (``disk_cache.DiskCache`` keeps it:
atomic writes, damage detected, bounded by ``TVMBRIDGE_CACHE_MAX_MB``). ``TVMBRIDGE_DISK_CACHE=0``
or ``CompileOptions(disk_cache=False)`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import tvm
from tvm import relax

from ..disk_cache import FORMAT, DiskCache, cache_dir, code_digest, enabled, max_bytes, warn_once
from ..parallel_launch import load_library
from .codegen import kernel_asserts, write_library
from .gemm_choice import machine

__all__ = [
    "ExecutableCache",
    "cache_key",
    "cached_compile",
    "stored",
    "code_digest",
    "enabled",
    "max_bytes",
    "warn_once",
]


def cache_key(
    mod: tvm.IRModule,
    target: tvm.target.Target,
    schedule: bool,
    fuse: bool,
    tuning_state: object,
    asserts: bool | None = None,
) -> str:
    """The digest of what a build reads (``tuning_state``: the tuning database's path and files'
    state, or None; ``asserts``: :func:`kernel_asserts` as the building thread sees it, which
    reads that thread's pass context)."""
    h = hashlib.sha256()
    h.update(tvm.ir.save_json(mod).encode())
    h.update(json.dumps(str(target.export()), sort_keys=True).encode())
    h.update(repr((schedule, fuse, tuning_state, kernel_asserts() if asserts is None else asserts, FORMAT)).encode())
    h.update(json.dumps(machine(), sort_keys=True).encode())
    h.update(code_digest().encode())
    return h.hexdigest()


def _read_executable(path: Path) -> relax.VMExecutable:
    return relax.VMExecutable(load_library(path))


class ExecutableCache(DiskCache[tvm.runtime.Executable]):
    """Executables by key in one directory (``<cache dir>/executables``)."""

    def __init__(self, root: Path | None = None, limit: int | None = None) -> None:
        super().__init__(
            root or cache_dir() / "executables", ".so", write_library, _read_executable, "compiled executable", limit
        )


def cached_compile(
    key: str, compile: Callable[[], tvm.runtime.Executable], cache: ExecutableCache | None = None
) -> tuple[tvm.runtime.Executable, bool]:
    """The executable for ``key`` from the disk cache, else ``compile()`` stored there; and
    whether it was loaded. A stored executable is used as the library just written: storing ran
    LLVM's code generation once, and the in-memory executable would run it again (its JIT) at its
    first VM."""
    cache = cache or ExecutableCache()
    exe = cache.load(key)
    if exe is not None:
        return exe, True
    return stored(key, compile(), cache), False


def stored(key: str, exe: tvm.runtime.Executable, cache: ExecutableCache) -> tvm.runtime.Executable:
    """``exe`` stored under ``key``, and the library just written loaded in its place (the
    in-memory one where it could not be stored)."""
    if cache.store(key, exe):
        return cache.load(key) or exe
    return exe
