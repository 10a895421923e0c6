"""A directory of cache entries shared between processes: what the bridge keeps on disk (compiled
executables, compile results) so that a new process loads instead of compiling.

An entry is a payload file named by its own digest, and a JSON record ``<key>.json`` that names it
(with its digest and size). Writes are atomic (a temporary file renamed into place, the record
last), so two processes storing one key at once leave one whole entry, and a reader sees the old
entry or the new one, never half of either. An entry that does not match its record, or that
``read`` cannot use, is a warning, is removed, and counts as absent. After a write the least
recently used entries go until the directory is within its bound.

Keys are digests of everything the payload depends on (the caller's business): an entry is never
stale, a changed input is another key.
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
from typing import Generic, TypeVar

T = TypeVar("T")
FORMAT = 2
_OFF = ("0", "false", "no", "off")


def enabled() -> bool:
    """False when the environment turns the disk caches off (``TVMBRIDGE_DISK_CACHE=0``)."""
    return os.environ.get("TVMBRIDGE_DISK_CACHE", "1").strip().lower() not in _OFF


def max_bytes() -> int:
    """Each directory's bound (``TVMBRIDGE_CACHE_MAX_MB``, default 2048 MiB)."""
    try:
        return int(float(os.environ.get("TVMBRIDGE_CACHE_MAX_MB", "2048")) * 2**20)
    except ValueError:
        return 2048 * 2**20


def cache_dir() -> Path:
    """Where the bridge keeps what it learned and compiled on this machine: ``$TVMBRIDGE_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/tvmbridge``, else ``~/.cache/tvmbridge``."""
    if os.environ.get("TVMBRIDGE_CACHE_DIR"):
        return Path(os.environ["TVMBRIDGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tvmbridge"


@functools.cache
def code_digest() -> str:
    """The bridge's own source and its analysis package's (passes, schedules, kernels and the
    capture min-cut shape what is cached), TVM's
    library, tvm-ffi's and torch's versions: a changed file here is a different key."""
    import torch
    import tvm
    import tvm_ffi

    import analysis

    h = hashlib.sha256()
    for package in (Path(__file__).resolve().parent, Path(analysis.__file__).resolve().parent):
        for path in sorted(package.rglob("*.py")):  # the analysis package's min-cut decides captures
            h.update(f"{package.name}/{path.relative_to(package)}".encode())
            h.update(path.read_bytes())
    libs = sorted(Path(tvm.__file__).parent.glob("lib*.so"))
    h.update(repr([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in libs]).encode())
    h.update(str(getattr(tvm_ffi, "__version__", "")).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class DiskCache(Generic[T]):
    """Entries by key in ``root``: ``write(value, path)`` makes a payload file, ``read(path)``
    makes the value back (raising on anything it cannot use). ``what`` names the entries in
    warnings."""

    def __init__(
        self,
        root: Path,
        suffix: str,
        write: Callable[[T, str], None],
        read: Callable[[Path], T],
        what: str,
        limit: int | None = None,
    ) -> None:
        self.root = root
        self.suffix = suffix
        self.write = write
        self.read = read
        self.what = what
        self.limit = max_bytes() if limit is None else limit

    def _record(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def _read_record(self, key: str) -> dict:
        meta = json.loads(self._record(key).read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"not a format {FORMAT} record")
        return meta

    def load(self, key: str) -> T | None:
        """The stored value, or None (absent; a damaged entry is removed, with a warning)."""
        if not self._record(key).is_file():
            return None
        payload = self.root / f"{key}{self.suffix}"
        try:
            meta = self._read_record(key)
            payload = self.root / meta["file"]
            if payload.stat().st_size != meta["size"] or file_digest(payload) != meta["sha256"]:
                raise ValueError("the file does not match its record (truncated or changed)")
            value = self.read(payload)
        except FileNotFoundError:  # another process removed the entry (evicted) after the check
            return None
        except Exception as exc:  # noqa: BLE001 - any damage: compile again, never fail the user's step
            warnings.warn(
                f"tvmbridge: the cached {self.what} {payload} is damaged ({str(exc).splitlines()[0][:200]}); "
                "removing it and compiling again",
                stacklevel=4,
            )
            self._remove(key)
            return None
        with contextlib.suppress(OSError):  # a cache shared read-only still serves
            os.utime(self._record(key))  # least recently used goes first
        return value

    def store(self, key: str, value: T) -> bool:
        """Write the entry; False (with a warning, once per message) where it cannot be written
        (a read-only directory, a value ``write`` cannot save). The payload is named by its own
        digest and the record, replaced atomically, names it."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=self.suffix)
            os.close(fd)
            try:
                self.write(value, tmp)
                digest = file_digest(Path(tmp))
                name = f"{key}-{digest[:16]}{self.suffix}"
                meta = {"format": FORMAT, "file": name, "sha256": digest, "size": os.path.getsize(tmp)}
                os.replace(tmp, self.root / name)  # the payload first: a record names a whole one
                _write_atomic(self._record(key), json.dumps({**meta, "created": time.time()}))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception as exc:  # noqa: BLE001 - the compile stands; only the cache is missed
            warn_once(
                f"tvmbridge: could not store the {self.what} in {self.root} ({exc}); "
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
                payload = self.root / self._read_record(record.stem)["file"]
                out.append((record.stat().st_mtime, payload.stat().st_size + record.stat().st_size, record.stem))
            except (OSError, ValueError, KeyError):  # removed or being replaced by another process
                continue
        return sorted(out)

    def evict(self, orphan_age_s: float = 600.0) -> None:
        """Remove least recently used entries until the directory is within its bound, and
        payloads no record names (a concurrent writer's, replaced) once older than
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
                named.add(self._read_record(key)["file"])
        for payload in self.root.glob(f"*{self.suffix}"):
            with contextlib.suppress(OSError):
                if payload.name not in named and time.time() - payload.stat().st_mtime > orphan_age_s:
                    payload.unlink()

    def remove(self, key: str) -> None:
        """The entry gone (if there is one)."""
        self._remove(key)

    def _remove(self, key: str) -> None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            (self.root / self._read_record(key)["file"]).unlink()
        with contextlib.suppress(OSError):
            self._record(key).unlink()


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@functools.cache
def warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=5)
