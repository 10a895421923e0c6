"""What the stages between the trace and the build made, kept on disk: a new process that traces
the same graph skips conversion, gradient, split and offload, and the build then loads its
executable from ``backend.executable_cache``.

The key is the traced graph's fingerprint (``compile.graph_fingerprint``: the graph's code, its
inputs' layouts, constants, state layout, requires_grad, options, device), the tuning database's
state, the machine, and the code digest (the bridge's source, TVM, tvm-ffi, torch): everything the
skipped stages read. An entry pickles the artifacts in :data:`STORED`; TVM objects in them go
through one ``tvm.ir.save_json`` of them all, so a var shared between the split's halves and its
joint graph is one var again after loading.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import tvm
import tvm_ffi

from ..backend.build import tuning_state
from ..backend.codegen import kernel_asserts
from ..backend.gemm_choice import machine
from ..devices import target_for
from ..disk_cache import FORMAT, DiskCache, cache_dir, code_digest
from .artifacts import Artifacts

# what the stages after the trace and before the build write that the compile's result or the
# build reads (``primal``, ``joint`` and ``captures`` live on in ``gradient`` and ``split``), and
# the executables' keys (the build need not serialize ``halves`` again to find them)
STORED = (
    "random_sites",
    "num_index_checks",
    "grad_param_indices",
    "gradient",
    "split",
    "halves",
    "gemm_choices",
    "build_keys",
)


def _resolve_op(qualified: str) -> torch._ops.OpOverload:
    namespace, name, overload = qualified.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


class _Pickler(pickle.Pickler):
    """TVM objects set aside (to be saved together as JSON), torch ops by name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.objects: list[tvm_ffi.Object] = []
        self._index: dict[tvm_ffi.Object, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, tvm_ffi.Object):
            return None
        if obj not in self._index:
            self._index[obj] = len(self.objects)
            self.objects.append(obj)
        return self._index[obj]

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return _resolve_op, (f"{obj.namespace}.{obj._opname}.{obj._overloadname}",)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, objects: Any) -> None:
        super().__init__(file)
        self.objects = objects

    def persistent_load(self, pid: Any) -> Any:
        return self.objects[pid]


# written by the build, after the others are encoded (:func:`encode` runs while it builds)
LATE = ("build_keys",)
EARLY = tuple(n for n in STORED if n not in LATE)


def encode(artifacts: Artifacts) -> bytes:
    """The :data:`EARLY` fields as bytes: a pickle, then the JSON of the TVM objects it names
    (serialized outside the GIL: it can run in a thread while the build runs)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump({name: getattr(artifacts, name) for name in EARLY})
    objects = tvm.ir.save_json(tvm.runtime.convert(pickler.objects)).encode()
    data = buf.getvalue()
    return len(data).to_bytes(8, "little") + data + objects


# an entry: the encoded early fields (or their encoding under way) and the late ones
Entry = tuple[bytes | Future, dict[str, Any]]


def dumps(entry: Entry) -> bytes:
    early, late = entry
    blob = early.result() if isinstance(early, Future) else early
    return len(blob).to_bytes(8, "little") + blob + json.dumps(late).encode()


def entry_of(artifacts: Artifacts) -> Entry:
    return encode(artifacts), {name: getattr(artifacts, name) for name in LATE}


def loads(blob: bytes) -> dict[str, Any]:
    """The fields :func:`dumps` stored."""
    m = int.from_bytes(blob[:8], "little")
    early, late = blob[8 : 8 + m], json.loads(blob[8 + m :].decode())
    n = int.from_bytes(early[:8], "little")
    objects = tvm_ffi.serialization.from_json_graph_str(early[8 + n :].decode())  # written by this version: no upgrade
    fields = _Unpickler(io.BytesIO(early[8 : 8 + n]), objects).load()
    if not isinstance(fields, dict) or not isinstance(late, dict):
        raise ValueError(f"an entry of another form ({type(fields)}, {type(late)})")
    fields.update(late)
    if set(fields) != set(STORED):
        raise ValueError(f"an entry of other fields ({sorted(fields)})")
    return fields


def result_key(fingerprint: str, artifacts: Artifacts) -> str:
    """The digest of what the stages between trace and build read, beyond the graph's fingerprint."""
    options = artifacts.options
    h = hashlib.sha256(fingerprint.encode())
    state = tuning_state(options.tuning_db) if options.tuning_db is not None else None
    h.update(repr((state, kernel_asserts(), FORMAT)).encode())  # the stored build key reads them too
    h.update(json.dumps(machine(), sort_keys=True).encode())
    assert artifacts.device is not None
    target = target_for(artifacts.device, options.fp_contract)  # a GPU's arch, the CPU's FMA: the build key's
    h.update(str(target.export()).encode())
    h.update(code_digest().encode())
    return h.hexdigest()


def _write(entry: Entry, path: str) -> None:
    Path(path).write_bytes(dumps(entry))


def _read(path: Path) -> dict[str, Any]:
    return loads(path.read_bytes())


class ResultCache(DiskCache[Any]):
    """Compile results by key in one directory (``<cache dir>/compiles``)."""

    def __init__(self, root: Path | None = None, limit: int | None = None) -> None:
        super().__init__(root or cache_dir() / "compiles", ".pkl", _write, _read, "compile result", limit)
