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
from .codegen import kernel_asserts, write_library
from .gemm_choice import machine

__all__ = [
    "ExecutableCache",
    "cache_key",
    "cached_compile",
    "cached_kernel_library",
    "code_digest",
    "enabled",
    "max_bytes",
    "warn_once",
]


def cache_key(mod: tvm.IRModule, target: tvm.target.Target, schedule: bool, fuse: bool, tuning_state: object) -> str:
    """The digest of what a build reads (``tuning_state``: the tuning database's path and files'
    state, or None)."""
    h = hashlib.sha256()
    h.update(tvm.ir.save_json(mod).encode())
    h.update(json.dumps(str(target.export()), sort_keys=True).encode())
    h.update(repr((schedule, fuse, tuning_state, kernel_asserts(), FORMAT)).encode())
    h.update(json.dumps(machine(), sort_keys=True).encode())
    h.update(code_digest().encode())
    return h.hexdigest()


def _read_executable(path: Path) -> relax.VMExecutable:
    return relax.VMExecutable(tvm.runtime.load_module(str(path)))


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
    exe = compile()
    if cache.store(key, exe):
        return cache.load(key) or exe, False
    return exe, False


def _write_kernel_library(lib: tvm.runtime.Module, path: str) -> None:
    """A kernel library as a shared object (the C compiler links TVM's object code)."""
    lib.export_library(path)


def _read_kernel_library(path: Path) -> tvm.runtime.Module:
    """A stored kernel library, loaded (raising on a file that is not one)."""
    return tvm.runtime.load_module(str(path))


def cached_kernel_library(name: str, make: Callable[[], tvm.IRModule], target: tvm.target.Target) -> tvm.runtime.Module:
    """A module of the bridge's own TIR kernels (``make()``; ``name`` tells them apart), compiled
    with ``tvm.compile`` or loaded from ``<cache dir>/kernels``: what each new process would
    otherwise parse and build again before its first step (the dropout-mask kernel). The kernels
    are the bridge's source, so the key is their name, the bridge's code digest, the target and
    the machine; ``make`` runs only to compile. With the disk cache off, compiled."""
    if not enabled():
        return tvm.compile(make(), target=target).mod
    h = hashlib.sha256(name.encode())
    h.update(json.dumps(str(target.export()), sort_keys=True).encode())
    h.update(json.dumps(machine(), sort_keys=True).encode())
    h.update(f"{code_digest()}{FORMAT}".encode())
    key = h.hexdigest()
    cache = DiskCache(cache_dir() / "kernels", ".so", _write_kernel_library, _read_kernel_library, "kernel library")
    lib = cache.load(key)
    if lib is not None:
        return lib
    lib = tvm.compile(make(), target=target).mod
    return (cache.load(key) if cache.store(key, lib) else None) or lib
