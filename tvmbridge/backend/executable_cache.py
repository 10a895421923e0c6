"""Compiled executables kept on disk, so that a new process with the same model loads instead of
compiling (as inductor's FX graph cache does for torch.compile).

Content-addressed: the key is a digest of everything the build reads: the Relax module it lowers
(its JSON), the target, the schedule options, the tuning database's state, the machine (CPU model,
ISA flags, threads) and the versions of TVM, tvm-ffi, torch and the bridge's own source. Equal keys
compile to the same code, so an entry is never stale: a changed pass, option or library is another
key. An entry is the shared library ``export_library`` writes, named by its own digest, and a JSON
record ``<key>.json`` that names it (with its digest and size); an entry that does not match its
record, or does not load, is a warning, is removed, and the module compiles again.

Writes are atomic (a temporary file renamed into place, the record last), so two processes storing
one module at once leave one whole entry. The directory is bounded (``TVMBRIDGE_CACHE_MAX_MB``,
default 2048): after a write the least recently used entries go. ``TVMBRIDGE_DISK_CACHE=0`` or
``CompileOptions(disk_cache=False)`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import tvm
from tvm import relax

from .codegen import write_library
from .gemm_choice import cache_dir, machine

FORMAT = 1
_OFF = ("0", "false", "no", "off")


def enabled() -> bool:
    """False when the environment turns the cache off (``TVMBRIDGE_DISK_CACHE=0``)."""
    return os.environ.get("TVMBRIDGE_DISK_CACHE", "1").strip().lower() not in _OFF


def max_bytes() -> int:
    """The directory's bound (``TVMBRIDGE_CACHE_MAX_MB``, default 2048 MiB)."""
    try:
        return int(float(os.environ.get("TVMBRIDGE_CACHE_MAX_MB", "2048")) * 2**20)
    except ValueError:
        return 2048 * 2**20


@functools.cache
def _code_digest() -> str:
    """The bridge's own source (its passes, schedules and kernels shape the compiled code), TVM's
    library and tvm-ffi's version: a changed file here is a different key."""
    import tvm_ffi

    h = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    libs = sorted(Path(tvm.__file__).parent.glob("lib*.so"))
    h.update(repr([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in libs]).encode())
    h.update(str(getattr(tvm_ffi, "__version__", "")).encode())
    return h.hexdigest()


def cache_key(mod: tvm.IRModule, target: tvm.target.Target, schedule: bool, fuse: bool, tuning_state: object) -> str:
    """The digest of what a build reads (``tuning_state``: the tuning database's path and files'
    state, or None)."""
    h = hashlib.sha256()
    h.update(tvm.ir.save_json(mod).encode())
    h.update(json.dumps(str(target.export()), sort_keys=True).encode())
    h.update(repr((schedule, fuse, tuning_state, FORMAT)).encode())
    h.update(json.dumps(machine(), sort_keys=True).encode())
    h.update(_code_digest().encode())
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ExecutableCache:
    """Executables by key in one directory (``<cache dir>/executables``)."""

    def __init__(self, root: Path | None = None, limit: int | None = None) -> None:
        self.root = root or cache_dir() / "executables"
        self.limit = max_bytes() if limit is None else limit

    def _record(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def _read_record(self, key: str) -> dict:
        meta = json.loads(self._record(key).read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"not a format {FORMAT} record")
        return meta

    def load(self, key: str) -> relax.VMExecutable | None:
        """The stored executable, or None (absent; a damaged entry is removed, with a warning)."""
        if not self._record(key).is_file():
            return None
        lib = self.root / f"{key}.so"
        try:
            meta = self._read_record(key)
            lib = self.root / meta["library"]
            if lib.stat().st_size != meta["size"] or _file_digest(lib) != meta["sha256"]:
                raise ValueError("the library does not match its record (truncated or changed)")
            exe = relax.VMExecutable(tvm.runtime.load_module(str(lib)))
        except Exception as exc:  # noqa: BLE001 - any damage: recompile, never fail the user's step
            warnings.warn(
                f"tvmbridge: the cached executable {lib} is damaged ({str(exc).splitlines()[0][:200]}); "
                "removing it and compiling again",
                stacklevel=4,
            )
            self._remove(key)
            return None
        with contextlib.suppress(OSError):  # a cache shared read-only still serves
            os.utime(self._record(key))  # least recently used goes first
        return exe

    def store(self, key: str, exe: tvm.runtime.Executable) -> bool:
        """Write the entry; False (with a warning) where it cannot be written (no C compiler to
        link the library, a read-only directory). The library is named by its own digest and the
        record, replaced atomically, names it: a process reading the entry while another writes
        it sees the old entry or the new one, whole."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".so")
            os.close(fd)
            try:
                write_library(exe, tmp)
                digest = _file_digest(Path(tmp))
                library = f"{key}-{digest[:16]}.so"
                meta = {"format": FORMAT, "library": library, "sha256": digest, "size": os.path.getsize(tmp)}
                os.replace(tmp, self.root / library)  # the library first: a record names a whole one
                _write_atomic(self._record(key), json.dumps({**meta, "created": time.time()}))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception as exc:  # noqa: BLE001 - the compile stands; only the cache is missed
            _warn_once(
                f"tvmbridge: could not store the compiled executable in {self.root} ({exc}); "
                "the next process compiles again (TVMBRIDGE_DISK_CACHE=0 turns the cache off)"
            )
            return False
        self.evict()
        return True

    def entries(self) -> list[tuple[float, int, str]]:
        """(last use, bytes, key) of each whole entry, least recently used first."""
        out = []
        for record in self.root.glob("*.json"):
            try:
                lib = self.root / self._read_record(record.stem)["library"]
                out.append((record.stat().st_mtime, lib.stat().st_size + record.stat().st_size, record.stem))
            except (OSError, ValueError, KeyError):  # removed or being replaced by another process
                continue
        return sorted(out)

    def evict(self, orphan_age_s: float = 600.0) -> None:
        """Remove least recently used entries until the directory is within its bound, and
        libraries no record names (a concurrent writer's, replaced) once older than
        ``orphan_age_s``."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, key in entries:
            if total <= self.limit:
                break
            self._remove(key)
            total -= size
        named = set()
        for _, _, key in self.entries():
            with contextlib.suppress(OSError, ValueError, KeyError):
                named.add(self._read_record(key)["library"])
        for lib in self.root.glob("*.so"):
            with contextlib.suppress(OSError):
                if lib.name not in named and time.time() - lib.stat().st_mtime > orphan_age_s:
                    lib.unlink()

    def _remove(self, key: str) -> None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            (self.root / self._read_record(key)["library"]).unlink()
        with contextlib.suppress(OSError):
            self._record(key).unlink()


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=5)


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
