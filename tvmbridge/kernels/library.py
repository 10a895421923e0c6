"""The bridge's own TIR kernels (the dropout-mask kernel) compiled once per machine: loaded from
``<cache dir>/kernels`` by every process after the first, which would otherwise parse and build
them again before its first step."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import tvm

from ..disk_cache import FORMAT, DiskCache, cache_dir, code_digest, enabled


def _write(lib: tvm.runtime.Module, path: str) -> None:
    """A kernel library as a shared object (the C compiler links TVM's object code)."""
    lib.export_library(path)


def _read(path: Path) -> tvm.runtime.Module:
    """A stored kernel library, loaded (raising on a file that is not one)."""
    from ..parallel_launch import load_library

    return load_library(path)


def _loaded(lib: tvm.runtime.Module) -> tvm.runtime.Module:
    """A library compiled in memory, as a library loaded from a temporary file where a launcher
    runs its parallel loops on PyTorch's threads (``parallel_launch``)."""
    from ..parallel_launch import launcher

    if launcher() is None:
        return lib
    with tempfile.TemporaryDirectory(prefix="tvmbridge-") as work:
        path = Path(work) / "kernels.so"
        try:
            _write(lib, str(path))
        except Exception:  # noqa: BLE001 - no C compiler: the in-memory library (TVM's pool)
            return lib
        return _read(path)


def cached_kernel_library(name: str, make: Callable[[], tvm.IRModule], target: tvm.target.Target) -> tvm.runtime.Module:
    """``tvm.compile(make(), target)``'s library, or the one an earlier process stored. The
    kernels are the bridge's source, so the key is their ``name``, the code digest (the bridge's
    source, TVM's libraries, torch's and tvm-ffi's versions) and the target (its CPU and
    features); ``make`` runs only to compile. With the disk cache off, compiled."""
    if not enabled():
        return _loaded(tvm.compile(make(), target=target).mod)
    h = hashlib.sha256(name.encode())
    h.update(json.dumps(str(target.export()), sort_keys=True).encode())
    h.update(f"{code_digest()}{FORMAT}".encode())
    key = h.hexdigest()
    cache = DiskCache(cache_dir() / "kernels", ".so", _write, _read, "kernel library")
    lib = cache.load(key)
    if lib is not None:
        return lib
    lib = tvm.compile(make(), target=target).mod
    return (cache.load(key) if cache.store(key, lib) else None) or _loaded(lib)
