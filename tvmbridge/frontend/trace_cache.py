"""What a trace learned, kept on disk: a new process whose first export of a call equals an
earlier one's skips the decomposition to core ATen (the larger half of a trace), and takes what
the decomposed program showed (outputs, updated buffers, symbolic dims, the decomposed graph's
digest) from the entry. The decomposed program itself is made only if something reads it: a
compile whose later stages are not in the disk cache, or a tool.

The key is the first export's digest (``frontend.digest``: every graph module's code, inputs'
layouts, constants, ranges), its signature, the call's structure and which of its tensors require
grad, the autocast state, and the code digest (the bridge's decompositions, torch's version):
everything the decomposition and its analyses read.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..disk_cache import FORMAT, DiskCache, cache_dir, code_digest
from .digest import program_digest
from .export import Deferred, RawTrace, TracedModule, decompose_call, export_call


@dataclass(frozen=True)
class TraceFacts:
    """What the decomposed program showed about the call (``TracedModule``'s fields past the
    call's own structure)."""

    num_user_outputs: int
    updated_buffers: tuple[str, ...]
    updated_inputs: tuple[int, ...]
    input_dims: tuple[tuple[int | str, ...], ...]
    ranges: dict[str, tuple[int | None, int | None]]
    grad_sources: tuple[frozenset[int], ...]
    no_grad_path: frozenset[int]
    constant_outputs: frozenset[int]
    cloned_inputs: frozenset[int]
    copied_outputs: frozenset[int]
    returned_inputs: dict[int, int]
    graph_digest: str
    coarsest_float: torch.dtype | None

    @classmethod
    def of(cls, traced: TracedModule) -> TraceFacts:
        return cls(**{name: getattr(traced, name) for name in cls.__dataclass_fields__})


def trace_key(raw: RawTrace) -> str:
    h = hashlib.sha256(program_digest(raw.exported).encode())
    h.update(
        repr(
            (
                str(raw.exported.graph_signature),
                str(raw.in_spec),
                str(raw.flat.seen.out_spec),
                raw.flat.seen.reassigned,  # not in the graph: a reassigned buffer's value is no output
                tuple(t.requires_grad for t in raw.tensors),  # a written input may not require grad
                raw.state.names,
                raw.state.is_parameter,  # a written parameter is refused, a written buffer is not
                str(torch.get_default_dtype()),
                str(raw.autocast),
                sorted((k, sorted(v)) for k, v in (raw.dynamic or {}).items()),
                FORMAT,
            )
        ).encode()
    )
    h.update(code_digest().encode())
    return h.hexdigest()


def _write(facts: TraceFacts, path: str) -> None:
    Path(path).write_bytes(pickle.dumps(facts, protocol=pickle.HIGHEST_PROTOCOL))


def _read(path: Path) -> TraceFacts:
    facts = pickle.loads(path.read_bytes())
    if not isinstance(facts, TraceFacts):
        raise ValueError(f"holds a {type(facts).__name__}, not trace facts")
    return facts


class TraceCache(DiskCache[TraceFacts]):
    """Trace facts by key in one directory (``<cache dir>/traces``)."""

    def __init__(self, root: Path | None = None, limit: int | None = None) -> None:
        super().__init__(root or cache_dir() / "traces", ".pkl", _write, _read, "trace", limit)


def _decomposed(raw: RawTrace, facts: TraceFacts, cache: TraceCache, key: str) -> Any:
    """The decomposed program the facts came from; a program of another digest means the entry
    does not describe this call (something the key misses): the entry goes, and the compile is an
    error, never a compile of the wrong graph."""
    traced = decompose_call(raw)
    if traced.graph_digest != facts.graph_digest:
        cache.remove(key)
        raise RuntimeError(
            "tvmbridge: the trace cache's entry for this call described another program (removed now; "
            "the next compile traces afresh); please report this, with the model"
        )
    return traced.exported


def cached_trace(
    module: Any, args: tuple, kwargs: dict | None, dynamic: dict[int, frozenset[int]] | None, cache: TraceCache
) -> tuple[TracedModule, bool]:
    """``export.trace`` through the cache; and whether the facts were loaded."""
    raw = export_call(module, args, kwargs, dynamic)
    key = trace_key(raw)
    facts = cache.load(key)
    if facts is not None:
        return raw.traced(Deferred(lambda: _decomposed(raw, facts, cache, key)), **vars(facts)), True
    traced = decompose_call(raw)
    cache.store(key, TraceFacts.of(traced))
    return traced, False
