"""The compile: a list of named stages, run by one small driver.

inputs -> trace -> convert -> dropout -> layer_norm -> dedup -> gradient -> simplify -> capture
-> split -> offload -> low_precision -> fast_math -> build. Each stage takes the :class:`Artifacts` made so far
and returns new ones (nothing is changed in place); the driver times it, keeps what it made in
``CompiledModule.stages[name]`` (Relax modules print with ``.show()``), and turns any failure
into a :class:`~tvmbridge.errors.ConversionError` naming the stage.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import tvm
from tqdm import tqdm
from tvm import relax

from analysis.tensors import tensor_leaves

from . import names
from .backend import build as backend_build
from .backend.fast_math import FastMathFloat32
from .backend.gemm_choice import ChoiceCache, GemmChooser, GemmDecision
from .backend.offload import ApplyOffloadPlan, gemm_problems, plan_offload
from .devices import SUPPORTED, target_for
from .errors import ConversionError, stage_errors
from .ir import copy_with_fresh_vars
from .frontend.export import TracedModule, trace
from .frontend.importer import RandomSite, to_relax
from .kernels.gemm import register_gemms
from .kernels.mt19937 import kernel_works
from .options import CompileOptions, with_overrides
from .partition.joint import JointGraph, count_primal_bindings, joint_graph
from .partition.policy import capture_all, choose_captures, op_flops
from .partition.split import SplitResult, split
from .passes.low_precision import Float32Opmath
from .passes import DecomposeForTraining, Dedup, ExternalizeRandom, GradientResult, Simplify, build_adjoint

@dataclass(frozen=True)
class Artifacts:
    """What the stages have made so far; each stage returns a new one."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    options: CompileOptions
    device: torch.device | None = None
    dynamic: dict[int, frozenset[int]] | None = None  # call tensor -> dims to trace symbolically
    sizes: dict[str, int] = field(default_factory=dict)  # symbolic dims at this call (for costs)
    traced: TracedModule | None = None
    primal: tvm.IRModule | None = None  # names.MAIN, through the passes before the gradient
    random_sites: tuple[RandomSite, ...] = ()
    num_index_checks: int = 0
    grad_param_indices: tuple[int, ...] = ()  # primal params (user inputs, then params) with a grad
    gradient: GradientResult | None = None
    joint: JointGraph | None = None
    captures: tuple[str, ...] = ()
    split: SplitResult | None = None
    halves: tvm.IRModule | None = None  # names.FORWARD, names.FORWARD_INFER, names.BACKWARD
    gemm_choices: tuple[GemmDecision, ...] = ()  # where each offloaded GEMM runs, and why
    executable: tvm.runtime.Executable | None = None


@dataclass(frozen=True)
class Stage:
    """One step of the compile: ``run`` makes new artifacts, ``shows`` picks what to keep."""

    name: str
    run: Callable[[Artifacts], Artifacts]
    shows: Callable[[Artifacts], Any]


def _inputs(a: Artifacts) -> Artifacts:
    """One device for inputs and parameters, one TVM supports."""
    tensors = tensor_leaves((a.args, a.kwargs)) + list(a.module.parameters())
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ConversionError(
            "inputs", f"inputs and parameters are on different devices ({', '.join(sorted(map(str, devices)))}); "
            "move them to one device before add_tvm_dispatch"
        )
    device = a.device or next(iter(devices), torch.device("cpu"))
    if device.type not in SUPPORTED:
        raise ConversionError("inputs", f"device {device} is not supported by TVM dispatch (cpu, cuda, rocm)")
    empty = [tuple(t.shape) for t in tensor_leaves((a.args, a.kwargs)) if t.numel() == 0]
    if empty:  # TVM's reductions over an empty axis do not give PyTorch's zeros
        raise ConversionError("inputs", f"the sample has a zero-size dimension {empty[0]}; compile for a "
                              "non-empty sample (calls with empty tensors then run PyTorch)")
    return dataclasses.replace(a, device=device)


def _trace(a: Artifacts) -> Artifacts:
    # traced under the caller's autocast state: its casts become ops of the graph, and the
    # variant's guard accepts calls under that state only
    traced = trace(a.module, a.args, a.kwargs, a.dynamic)
    if a.dynamic and not traced.symbolic:
        raise ConversionError("trace", "no dimension stayed symbolic: the module's code fixes every size marked dynamic")
    return dataclasses.replace(a, traced=traced, sizes=symbol_sizes(traced, tensor_leaves((a.args, a.kwargs))))


def symbol_sizes(traced: TracedModule, tensors: list[torch.Tensor]) -> dict[str, int]:
    """Each shape symbol's size in the given call (symbols bound by a dim of their own)."""
    sizes: dict[str, int] = {}
    for dims, t in zip(traced.input_dims, tensors):
        for d, size in zip(dims, t.shape):
            if isinstance(d, str) and d.isidentifier():
                sizes.setdefault(d, int(size))
    return sizes


def _convert(a: Artifacts) -> Artifacts:
    converted = to_relax(a.traced, a.options.converters)
    return dataclasses.replace(a, primal=converted.mod, random_sites=converted.random_sites,
                               num_index_checks=converted.num_index_checks)


def _random(a: Artifacts) -> Artifacts:
    mod = tvm.transform.Sequential([ExternalizeRandom(), relax.transform.CanonicalizeBindings()])(a.primal)
    return dataclasses.replace(a, primal=mod)


def _layer_norm(a: Artifacts) -> Artifacts:
    return dataclasses.replace(a, primal=DecomposeForTraining()(a.primal))


def _dedup(a: Artifacts) -> Artifacts:
    return dataclasses.replace(a, primal=Dedup()(a.primal))


def _is_float(dtype: Any) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


def _grad_indices(a: Artifacts) -> tuple[int, ...]:
    """Float user inputs (but those written in place), then parameters that require grad, by primal
    parameter position; those no output depends on are left out (their gradient is None, not zeros)."""
    func = a.primal[names.MAIN]
    n_user = a.traced.num_user_inputs
    idx = [i for i in range(n_user) if _is_float(func.params[i].ty.dtype) and i not in a.traced.updated_inputs]
    state = a.traced.state
    tensors = state.lookup(a.module)
    idx += [n_user + j for j, t in enumerate(tensors) if state.is_parameter[j] and t.requires_grad]
    return tuple(i for i in idx if i not in a.traced.no_grad_path)  # PyTorch leaves those None


def differentiable_outputs(func: relax.Function, num_user_outputs: int) -> list[bool]:
    """The module's own float outputs get a gradient; updated buffers and index flags do not."""
    fields = func.ret_ty.fields if isinstance(func.ret_ty, relax.TupleType) else [func.ret_ty]
    return [i < num_user_outputs and _is_float(f.dtype) for i, f in enumerate(fields)]


def _gradient(a: Artifacts) -> Artifacts:
    indices = _grad_indices(a)
    func = a.primal[names.MAIN]
    grad = build_adjoint(func, list(indices), differentiable_outputs(func, a.traced.num_user_outputs))
    return dataclasses.replace(a, grad_param_indices=indices, gradient=grad)


def _simplify(a: Artifacts) -> Artifacts:
    adjoint = Simplify()(tvm.IRModule({names.ADJOINT: a.gradient.adjoint}))[names.ADJOINT]
    grad = dataclasses.replace(a.gradient, adjoint=adjoint)
    joint = joint_graph(grad, count_primal_bindings(a.primal[names.MAIN], adjoint), a.sizes)
    return dataclasses.replace(a, gradient=grad, joint=joint)


def _capture(a: Artifacts) -> Artifacts:
    return dataclasses.replace(a, captures=tuple(choose_captures(a.joint, a.options)))


def _split(a: Artifacts) -> Artifacts:
    halves = split(a.gradient, a.joint, list(a.captures))
    # FORWARD_INFER: the primal function alone (outputs, no captures), for calls that need no
    # gradient (no_grad, or nothing requires grad): nothing is kept for a backward that never comes.
    # One module holds all three; a Relax var may be defined in one function only, and the
    # halves share the adjoint's vars (the backward recomputes primal values), so each gets its own.
    fresh = copy_with_fresh_vars
    infer = fresh(a.primal[names.MAIN]).with_attr("global_symbol", names.FORWARD_INFER)
    mod = tvm.IRModule({names.FORWARD: fresh(halves.forward), names.FORWARD_INFER: infer,
                        names.BACKWARD: fresh(halves.backward)})
    mod = tvm.transform.Sequential([Dedup(), Simplify()])(mod)
    return dataclasses.replace(a, split=halves, halves=mod)


def _low_precision(a: Artifacts) -> Artifacts:
    return dataclasses.replace(a, halves=Float32Opmath()(a.halves))


def _offload(a: Artifacts) -> Artifacts:
    """The chooser decides each GEMM (timing under ``auto``), the plan records it, the pass
    applies it: only the first step measures or touches a cache."""
    backend = a.options.gemm_backend(a.device.type)
    if backend is None:
        return a
    # with a tuning database, the GEMM choices live in it (tvmbridge tune measures them there)
    cache = ChoiceCache(Path(a.options.tuning_db) / "gemm_choices.json") if a.options.tuning_db else None
    if cache is None and backend == "auto":
        cache = ChoiceCache()  # this machine's choices, in the user's cache directory
    chooser = GemmChooser(backend, cache)
    choices = chooser.choose_all(gemm_problems(a.halves, a.sizes))
    plan = plan_offload(a.halves, a.sizes, choices)
    register_gemms()  # the packed functions the offloaded calls name
    return dataclasses.replace(a, halves=ApplyOffloadPlan(plan)(a.halves), gemm_choices=plan.decisions)


def _fast_math(a: Artifacts) -> Artifacts:
    return dataclasses.replace(a, halves=FastMathFloat32(a.halves)) if a.options.fast_math else a


def _build(a: Artifacts) -> Artifacts:
    exe = backend_build.compile_module(a.halves, target_for(a.device), a.options.cpu_schedules, a.options.fuse,
                                       a.options.tuning_db)
    if a.device.type == "cpu" and a.random_sites and a.options.mask_kernel:
        kernel_works()  # builds and checks the mask kernel now, not on the first call
    backend_build.load(exe, a.device)  # loads in this thread now: a failure is the build stage's
    return dataclasses.replace(a, executable=exe)


STAGES: tuple[Stage, ...] = (
    Stage("inputs", _inputs, lambda a: a.device),
    Stage("trace", _trace, lambda a: a.traced.exported),
    Stage("convert", _convert, lambda a: a.primal),
    Stage("random", _random, lambda a: a.primal),
    Stage("layer_norm", _layer_norm, lambda a: a.primal),
    Stage("dedup", _dedup, lambda a: a.primal),
    Stage("gradient", _gradient, lambda a: tvm.IRModule({names.ADJOINT: a.gradient.adjoint})),
    Stage("simplify", _simplify, lambda a: tvm.IRModule({names.ADJOINT: a.gradient.adjoint})),
    Stage("capture", _capture, lambda a: list(a.captures)),
    Stage("split", _split, lambda a: a.halves),
    Stage("offload", _offload, lambda a: a.halves),
    Stage("low_precision", _low_precision, lambda a: a.halves),
    Stage("fast_math", _fast_math, lambda a: a.halves),
    Stage("build", _build, lambda a: a.executable),
)
STAGE_NAMES = tuple(s.name for s in STAGES)


def run_stages(
    artifacts: Artifacts, stages: tuple[Stage, ...] | None = None
) -> tuple[Artifacts, dict[str, Any], dict[str, float]]:
    """Run ``stages`` (default :data:`STAGES`) in order: the final artifacts, what each stage
    made, seconds per stage."""
    stages = STAGES if stages is None else stages
    shown: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    progress = artifacts.options.progress
    show_bar = sys.stderr.isatty() if progress is None else progress
    t_start = time.perf_counter()
    for stage in tqdm(stages, desc="tvmbridge compile", unit="stage", disable=not show_bar, leave=False):
        t = time.perf_counter()
        with stage_errors(stage.name):
            artifacts = stage.run(artifacts)
            shown[stage.name] = stage.shows(artifacts)
        seconds[stage.name] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t_start
    return artifacts, shown, seconds


@dataclass
class CompiledModule:
    """A module compiled for one call signature: both halves in one executable, and everything
    needed to call them."""

    traced: TracedModule
    device: torch.device
    options: CompileOptions
    random_sites: list[RandomSite]
    num_index_checks: int
    grad_param_indices: list[int]  # primal params (user inputs, then state) that get a gradient
    differentiable: tuple[bool, ...]  # per output
    adjoint: relax.Function = field(repr=False)  # the joint forward+backward, simplified
    split: SplitResult = field(repr=False)
    executable: tvm.runtime.Executable = field(repr=False)
    compile_seconds: dict[str, float] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict, repr=False)
    sizes: dict[str, int] = field(default_factory=dict)  # symbolic dims at the compiled sample
    gemm_choices: tuple[GemmDecision, ...] = ()
    _pool: list[relax.VirtualMachine] = field(default_factory=list, repr=False)
    _pool_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _instrument: Callable | None = field(default=None, repr=False)

    @property
    def num_outputs(self) -> int:
        """All outputs: the module's own, then updated buffers, then index-range flags."""
        return self.split.num_outputs

    @contextlib.contextmanager
    def vm(self) -> Iterator[relax.VirtualMachine]:
        """A VM of this module's executable, for one call: a VM's registers belong to the call
        running on it, so concurrent calls each borrow their own (from a pool: making one costs
        far more than a call, so short-lived threads reuse them)."""
        with self._pool_lock:
            vm = self._pool.pop() if self._pool else None
        if vm is None:
            vm = backend_build.load(self.executable, self.device)
            if self._instrument is not None:
                vm.set_instrument(self._instrument)
        try:
            yield vm
        finally:
            with self._pool_lock:
                self._pool.append(vm)

    def set_instrument(self, instrument: Callable | None) -> None:
        """``VirtualMachine.set_instrument`` on every VM of this module, now and later (None: off)."""
        self._instrument = instrument
        with self._pool_lock:
            for vm in self._pool:
                vm.set_instrument(instrument if instrument is not None else (lambda *a: 0))

    @functools.cached_property
    def written(self) -> frozenset[int]:
        """Positions among the call's tensors (user inputs, then state) that the call writes in place:
        a call that needs gradients hands its autograd Function copies of them, so the backward (and
        a rerun of PyTorch's forward for a double backward) sees them as they were before the write."""
        traced = self.traced
        n_user = traced.num_user_inputs
        return frozenset({*traced.updated_inputs, *(n_user + traced.state.names.index(n) for n in traced.updated_buffers)})

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
            f"compile {t.get('total', 0):.1f}s (build {t.get('build', 0):.1f}s)"
        )


def compile_training(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    options: CompileOptions | None = None,
    *,
    device: torch.device | None = None,
    dynamic: dict[int, frozenset[int]] | None = None,
    cache: CompileCache | None = None,
    **overrides: Any,
) -> CompiledModule:
    """Compile forward and backward of ``module`` for the signature of ``(args, kwargs)``.

    ``options`` (default :class:`CompileOptions()`) with keyword ``overrides`` of its fields
    (``capture="all"``, ``memory_budget=0.3``, ...). ``dynamic`` marks dims of the call's tensors
    (by position among them) to compile symbolically: one executable for every size there.
    With a ``cache``, a module whose traced graph equals one compiled before reuses that compile.
    Every failure is a ``ConversionError`` naming the stage.
    """
    opts = with_overrides(options, overrides)
    args = args if isinstance(args, tuple) else (args,)
    start = Artifacts(module=module, args=args, kwargs=dict(kwargs or {}), options=opts, device=device,
                      dynamic=dynamic)
    after_trace, shown, seconds = run_stages(start, STAGES[:2])
    key = graph_fingerprint(after_trace) if cache is not None else None
    reused = cache.get(key) if cache is not None else None
    if reused is not None:
        return cache.reuse(reused, after_trace.traced, dict(after_trace.sizes), seconds)
    done, shown_rest, seconds_rest = run_stages(after_trace, STAGES[2:])
    seconds = {**seconds, **seconds_rest, "total": seconds["total"] + seconds_rest["total"]}
    compiled = CompiledModule(
        traced=done.traced, device=done.device, options=opts, random_sites=list(done.random_sites),
        num_index_checks=done.num_index_checks,
        grad_param_indices=list(done.grad_param_indices), differentiable=done.gradient.differentiable,
        adjoint=done.gradient.adjoint, split=done.split, executable=done.executable,
        compile_seconds=seconds, stages={**shown, **shown_rest}, sizes=dict(done.sizes),
        gemm_choices=done.gemm_choices,
    )
    if cache is not None:
        cache.put(key, compiled)
    return compiled


def graph_fingerprint(a: Artifacts) -> str:
    """What the stages after the trace depend on: the exported graph's code, its inputs' metadata
    and ranges, its lifted constants, the state's layout and which parameters require grad, the
    outputs, the options and the device. Equal fingerprints compile to the same code; the state
    is an input, so modules with equal graphs (a model's identical layers) can share it."""
    ep = a.traced.exported
    h = hashlib.sha256(ep.graph_module.code.encode())
    for node in ep.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        h.update(repr((node.name, tuple(map(str, getattr(val, "shape", ()))), str(getattr(val, "dtype", "")))).encode())
    for name, value in sorted(ep.constants.items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(repr((tuple(value.shape), value.dtype)).encode())
            h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())  # 0-d too
    state = a.traced.state
    grads = tuple(t.requires_grad for t in state.lookup(a.module))
    h.update(repr((sorted(map(str, ep.range_constraints.items())), state.names, state.is_parameter,
                   sorted(state.aliases.items()), grads, a.traced.updated_buffers, a.traced.updated_inputs,
                   a.traced.num_user_outputs,
                   a.traced.input_dims, str(a.traced.out_spec), repr(a.options), str(a.device),
                   str(a.traced.autocast))).encode())
    return h.hexdigest()


class CompileCache:
    """Compiled modules by :func:`graph_fingerprint`, shared by every dispatched module of the
    process (bounded; the oldest entry goes first)."""

    def __init__(self, limit: int = 16) -> None:
        self.limit = limit
        self._entries: dict[str, CompiledModule] = {}
        self._lock = threading.Lock()
        self.hits = 0

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = 0

    def get(self, key: str) -> CompiledModule | None:
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, compiled: CompiledModule) -> None:
        with self._lock:
            self._entries[key] = compiled
            while len(self._entries) > self.limit:
                self._entries.pop(next(iter(self._entries)))

    def reuse(self, compiled: CompiledModule, traced: TracedModule, sizes: dict[str, int],
              seconds: dict[str, float]) -> CompiledModule:
        """``compiled`` for another module with an equal graph: its own trace (the call's form,
        outputs), the same executable, VMs of its own."""
        with self._lock:
            self.hits += 1
        return dataclasses.replace(compiled, traced=traced, sizes=sizes, compile_seconds={**seconds, "reused": 1.0},
                                   _pool=[], _pool_lock=threading.Lock(), _instrument=None)


SHARED_CACHE = CompileCache()  # one per process: the dispatcher's default
