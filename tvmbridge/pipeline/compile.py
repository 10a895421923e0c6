"""A training compile from start to end: the stages run, or an equal graph's compile reused.

:func:`compile_result` traces, fingerprints the traced graph (:func:`graph_fingerprint`) and
looks it up in ``CACHES.compiles``: identical layers of one model compile once (the state is an
input). The result is plain data; ``runtime.compiled`` makes it callable.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import tvm
from tvm import relax

from ..backend.gemm_choice import GemmDecision
from ..caches import CACHES
from ..disk_cache import enabled as disk_cache_enabled
from ..frontend.export import TracedModule, release_program
from ..frontend.sites import RandomSite
from ..options import CompileOptions
from ..partition.policy import capture_all, op_flops
from ..partition.split import SplitResult
from . import stages
from .artifacts import Artifacts
from .driver import run_stages
from .parts import INFER, TRAIN, Parts
from .result_cache import LATE, ResultCache, encode, result_key


@dataclass
class CompileResult:
    """A module compiled for one call signature: its executables by part (training: forward and
    backward; inference: forward only; each built when first needed, ``pipeline.parts``), and
    everything needed to call them (``runtime.compiled.CompiledModule`` adds the VMs)."""

    traced: TracedModule
    device: torch.device
    options: CompileOptions
    random_sites: list[RandomSite]
    num_index_checks: int
    grad_param_indices: list[int]  # primal params (user inputs, then state) that get a gradient
    differentiable: tuple[bool, ...]  # per output
    adjoint: relax.Function = field(repr=False)  # the joint forward+backward, simplified
    split: SplitResult = field(repr=False)
    parts: Parts = field(repr=False)
    first_part: str = TRAIN  # the part the compile built; the other is built when a call first needs it
    compile_seconds: dict[str, float] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict, repr=False)
    sizes: dict[str, int] = field(default_factory=dict)  # symbolic dims at the compiled sample
    gemm_choices: tuple[GemmDecision, ...] = ()
    result_loaded: bool = False  # the stages between trace and build loaded from the disk cache
    trace_loaded: bool = False  # the decomposition skipped: what it shows loaded from the disk cache

    @property
    def executable(self) -> tvm.runtime.Executable:
        """The training part's executable (forward and backward), built now if not yet."""
        return self.parts.get(TRAIN)

    @property
    def executable_loaded(self) -> bool:
        """The compile loaded its part's executable from the disk cache instead of building it."""
        return self.parts.loaded.get(self.first_part, False)

    def seconds_total(self) -> float:
        """The compile's seconds and those of a part built later, when a call first needed it."""
        later = sum(t for part, t in self.parts.seconds.items() if part != self.first_part)
        return self.compile_seconds.get("total", 0.0) + later

    def parts_built(self) -> str:
        """Which parts are built: "training and inference parts", "training part only", ..."""
        built = [p for p in (TRAIN, INFER) if self.parts.built(p)]
        return " and ".join(f"{p}" for p in built) + (" parts" if len(built) > 1 else " part only")

    @property
    def num_outputs(self) -> int:
        """All outputs: the module's own, then updated buffers, then index-range flags."""
        return self.split.num_outputs

    @functools.cached_property
    def written(self) -> frozenset[int]:
        """Positions among the call's tensors (user inputs, then state) that the call writes in place:
        a call that needs gradients hands its autograd Function copies of them, so the backward (and
        a rerun of PyTorch's forward for a double backward) sees them as they were before the write."""
        traced = self.traced
        n_user = traced.num_user_inputs
        return frozenset(
            {*traced.updated_inputs, *(n_user + traced.state.names.index(n) for n in traced.updated_buffers)}
        )

    @functools.cached_property
    def read_as_copies(self) -> frozenset[int]:
        """Inputs the backward reads that the forward copies (``TracedModule.cloned_inputs``) and
        the call does not copy already (``written``): the call saves a copy, as PyTorch does."""
        read = set(self.split.backward_param_indices)
        return frozenset(i for i in self.traced.cloned_inputs if i in read and i not in self.written)

    def captured_bytes(self) -> int:
        """Bytes of the forward values TVM keeps for the backward (masks not included)."""
        return self.split.joint.bytes_of(self.split.captures)

    def mask_bytes(self) -> int:
        """Bytes of the random inputs (dropout masks, ...) the backward reads (kept alongside the
        captures)."""
        joint = self.split.joint
        first = len(joint.params) - len(self.random_sites)
        return joint.bytes_of([joint.params[i] for i in self.split.backward_param_indices if i >= first])

    def save_all_bytes(self) -> int:
        return self.split.joint.bytes_of(capture_all(self.split.joint))

    def recompute_flops(self) -> float:
        joint = self.split.joint
        return sum(op_flops(joint, joint.nodes[n]) for n in self.split.recomputed)

    def summary(self) -> str:
        t = self.compile_seconds
        return (
            f"{len(self.split.captures)} captured values ({self.captured_bytes() / 2**20:.2f} MiB), "
            f"{len(self.split.recomputed)} recomputed, {len(self.random_sites)} random inputs; "
            f"compile {t.get('total', 0):.1f}s (build of the {self.first_part} part {t.get('build', 0):.1f}s"
            f"{', loaded from the disk cache' if self.executable_loaded else ''}"
            f"{'; gradient, split and offload loaded from the disk cache' if self.result_loaded else ''})"
        )


def compile_result(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    options: CompileOptions,
    *,
    device: torch.device | None = None,
    dynamic: dict[int, frozenset[int]] | None = None,
    reuse: bool = False,
    first_part: str = TRAIN,
) -> CompileResult:
    """Forward and backward of ``module`` compiled for the signature of ``(args, kwargs)``
    (``dynamic``: dims of the call's tensors, by position among them, to compile symbolically;
    ``first_part``: the part built now, ``pipeline.parts``).
    With ``reuse``, a traced graph equal to one compiled before reuses that compile."""
    start = Artifacts(
        module=module, args=args, kwargs=kwargs, options=options, device=device, dynamic=dynamic, first_part=first_part
    )
    after_trace, shown, seconds = run_stages(start, stages.STAGES[:2])
    key = graph_fingerprint(after_trace)
    reused = CACHES.compiles.get(key) if reuse else None
    if reused is not None:  # another module's trace (the call's form, outputs), the same executable
        release_program(after_trace.traced)
        return dataclasses.replace(
            reused,
            traced=after_trace.traced,
            sizes=dict(after_trace.sizes),
            trace_loaded=after_trace.trace_loaded,
            compile_seconds={**seconds, "reused": 1.0},
        )
    stable = options.compile_key() is not None  # a callable's code is in no key: no disk cache for it
    disk = ResultCache() if options.disk_cache and disk_cache_enabled() and stable else None
    disk_key = result_key(key, after_trace) if disk is not None else ""
    stored = disk.load(disk_key) if disk is not None else None
    if stored is not None:  # the stages between trace and build ran in an earlier process
        done, shown_rest, seconds_rest = run_stages(dataclasses.replace(after_trace, **stored), (stages.STAGES[-1],))
        shown_rest = {"fast_math": done.halves, **shown_rest}
    else:
        done, shown_rest, seconds_rest = run_stages(after_trace, stages.STAGES[2:-1])
        # the entry is encoded while the build runs (TVM serializes outside the GIL), and written,
        # whole, before the compile returns
        with ThreadPoolExecutor(1, thread_name_prefix="tvmbridge-result") as pool:
            encoding = pool.submit(encode, done) if disk is not None else None
            done, shown_build, seconds_build = run_stages(done, stages.STAGES[-1:])
            if disk is not None and encoding is not None:
                disk.store(disk_key, (encoding, {name: getattr(done, name) for name in LATE}))
        shown_rest = {**shown_rest, **shown_build}
        seconds_rest = {**seconds_rest, **seconds_build, "total": seconds_rest["total"] + seconds_build["total"]}
    seconds = {**seconds, **seconds_rest, "total": seconds["total"] + seconds_rest["total"]}
    release_program(done.traced)
    assert done.traced is not None and done.device is not None and done.gradient is not None and done.split is not None
    assert done.parts is not None
    result = CompileResult(
        traced=done.traced,
        device=done.device,
        options=options,
        random_sites=list(done.random_sites),
        num_index_checks=done.num_index_checks,
        grad_param_indices=list(done.grad_param_indices),
        differentiable=done.gradient.differentiable,
        adjoint=done.gradient.adjoint,
        split=done.split,
        parts=done.parts,
        first_part=done.first_part,
        compile_seconds=seconds,
        stages={**shown, **shown_rest},
        sizes=dict(done.sizes),
        gemm_choices=done.gemm_choices,
        result_loaded=stored is not None,
        trace_loaded=done.trace_loaded,
    )
    if reuse:
        CACHES.compiles.put(key, result)
    return result


def graph_fingerprint(a: Artifacts) -> str:
    """What the stages after the trace depend on: the exported graph's code, its inputs' metadata
    (shapes, dtypes, strides) and ranges, its lifted constants, the state's layout and which
    parameters require grad, the outputs, the options and the device. Equal fingerprints compile
    to the same code; the state is an input, so modules with equal graphs (a model's identical layers) can share it."""
    assert a.traced is not None
    h = hashlib.sha256(a.traced.graph_digest.encode())  # the graph, its inputs' layouts, constants, ranges
    state = a.traced.state
    grads = tuple(t.requires_grad for t in state.tensors(a.module))
    h.update(
        repr(
            (
                state.names,
                state.is_parameter,
                sorted(state.aliases.items()),
                grads,
                a.traced.updated_buffers,
                a.traced.updated_inputs,
                a.traced.num_user_outputs,
                a.traced.input_dims,
                sorted(a.traced.ranges.items()),
                sorted(a.traced.no_grad_path),
                sorted(a.traced.constant_outputs),
                str(a.traced.out_spec),
                a.options.compile_key() or repr(a.options),  # in-process only where it holds callables
                str(a.device),
                str(a.traced.autocast),
            )
        ).encode()
    )
    return h.hexdigest()
