"""The training compile's stages, in order, each a function of the artifacts made so far.

inputs -> trace -> convert -> random -> layer_norm -> dedup -> gradient -> simplify -> capture
-> split -> offload -> low_precision -> convolutions -> fast_math -> build. Each returns new artifacts (nothing is
changed in place) and declares what it reads and writes (checked by ``pipeline.driver``).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import tvm
from tvm import relax

from analysis.tensors import tensor_leaves

from .. import disk_cache, names
from ..backend import build as backend_build
from ..backend.conv_offload import OffloadConvolutions
from ..backend.fast_math import FastMathFloat32
from ..backend.gemm_choice import ChoiceCache, GemmChooser
from ..backend.offload import ApplyOffloadPlan, gemm_problems, plan_offload
from ..devices import SUPPORTED, target_for
from ..errors import ConversionError, stage_errors
from ..frontend.export import Deferred, TracedModule, trace
from ..frontend.importer import to_relax
from ..frontend.trace_cache import TraceCache, cached_trace
from ..ir import copy_with_fresh_vars, per_function
from ..kernels.conv import register_convs
from ..kernels.gemm import register_gemms
from ..kernels.mt19937 import kernel_works
from ..partition.joint import count_primal_bindings, joint_graph
from ..partition.policy import choose_captures
from ..partition.split import split
from ..passes import DecomposeForTraining, Dedup, DedupAndSimplify, ExternalizeRandom, Simplify, build_adjoint
from ..passes.accumulation import LongSumsInFloat64
from ..passes.low_precision import Float32Opmath
from .artifacts import INPUTS, Artifacts, Stage
from .parts import FUNCTIONS, Parts, part_module


def _inputs(a: Artifacts) -> Artifacts:
    """One device for inputs and parameters, one TVM supports."""
    tensors = tensor_leaves((a.args, a.kwargs)) + list(a.module.parameters())
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ConversionError(
            "inputs",
            f"inputs and parameters are on different devices ({', '.join(sorted(map(str, devices)))}); "
            "move them to one device before add_tvm_dispatch",
        )
    device = a.device or next(iter(devices), torch.device("cpu"))
    if device.type not in SUPPORTED:
        raise ConversionError("inputs", f"device {device} is not supported by TVM dispatch (cpu, cuda, rocm)")
    empty = [tuple(t.shape) for t in tensor_leaves((a.args, a.kwargs)) if t.numel() == 0]
    if empty:  # TVM's reductions over an empty axis do not give PyTorch's zeros
        raise ConversionError(
            "inputs",
            f"the sample has a zero-size dimension {empty[0]}; compile for a "
            "non-empty sample (calls with empty tensors then run PyTorch)",
        )
    return dataclasses.replace(a, device=device)


def _trace(a: Artifacts) -> Artifacts:
    # traced under the caller's autocast state: its casts become ops of the graph, and the
    # variant's guard accepts calls under that state only
    if a.options.disk_cache and disk_cache.enabled():
        traced, loaded = cached_trace(a.module, a.args, a.kwargs, a.dynamic, TraceCache())
    else:
        traced, loaded = trace(a.module, a.args, a.kwargs, a.dynamic), False
    if a.dynamic and not traced.symbolic:
        raise ConversionError(
            "trace", "no dimension stayed symbolic: the module's code fixes every size marked dynamic"
        )
    sizes = symbol_sizes(traced, tensor_leaves((a.args, a.kwargs)))
    return dataclasses.replace(a, traced=traced, sizes=sizes, trace_loaded=loaded)


def symbol_sizes(traced: TracedModule, tensors: list[torch.Tensor]) -> dict[str, int]:
    """Each shape symbol's size in the given call (symbols bound by a dim of their own)."""
    sizes: dict[str, int] = {}
    for dims, t in zip(traced.input_dims, tensors):
        for d, size in zip(dims, t.shape):
            if isinstance(d, str) and d.isidentifier():
                sizes.setdefault(d, int(size))
    return sizes


def _convert(a: Artifacts) -> Artifacts:
    assert a.traced is not None
    converted = to_relax(a.traced, a.options.converters)
    return dataclasses.replace(
        a, primal=converted.mod, random_sites=converted.random_sites, num_index_checks=converted.num_index_checks
    )


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
    assert a.primal is not None and a.traced is not None
    func = a.primal[names.MAIN]
    n_user = a.traced.num_user_inputs
    idx = [i for i in range(n_user) if _is_float(func.params[i].ty.dtype) and i not in a.traced.updated_inputs]
    state = a.traced.state
    tensors = state.tensors(a.module)
    # parameters, and tensors kept on the module with a graph behind them (old-style weight_norm's
    # weight, made from weight_g and weight_v by a pre-hook each call): their gradient goes on through it
    idx += [n_user + j for j, t in enumerate(tensors) if t.requires_grad]
    return tuple(i for i in idx if i not in a.traced.no_grad_path)  # PyTorch leaves those None


def differentiable_outputs(func: relax.Function, num_user_outputs: int) -> list[bool]:
    """The module's own float outputs get a gradient; updated buffers and index flags do not."""
    fields = func.ret_ty.fields if isinstance(func.ret_ty, relax.TupleType) else [func.ret_ty]
    return [i < num_user_outputs and _is_float(f.dtype) for i, f in enumerate(fields)]


def _gradient(a: Artifacts) -> Artifacts:
    assert a.primal is not None and a.traced is not None
    indices = _grad_indices(a)
    func = a.primal[names.MAIN]
    grad = build_adjoint(func, list(indices), differentiable_outputs(func, a.traced.num_user_outputs))
    return dataclasses.replace(a, grad_param_indices=indices, gradient=grad)


def _simplify(a: Artifacts) -> Artifacts:
    assert a.gradient is not None and a.primal is not None
    adjoint = Simplify()(tvm.IRModule({names.ADJOINT: a.gradient.adjoint}))[names.ADJOINT]
    grad = dataclasses.replace(a.gradient, adjoint=adjoint)
    joint = joint_graph(grad, count_primal_bindings(a.primal[names.MAIN], adjoint), a.sizes)
    return dataclasses.replace(a, gradient=grad, joint=joint)


def _capture(a: Artifacts) -> Artifacts:
    assert a.joint is not None
    return dataclasses.replace(a, captures=tuple(choose_captures(a.joint, a.options)))


def _split(a: Artifacts) -> Artifacts:
    assert a.gradient is not None and a.joint is not None and a.primal is not None
    halves = split(a.gradient, a.joint, list(a.captures))
    # FORWARD_INFER: the primal function alone (outputs, no captures), for calls that need no
    # gradient (no_grad, or nothing requires grad): nothing is kept for a backward that never comes.
    # One module holds all three; a Relax var may be defined in one function only, and the
    # halves share the adjoint's vars (the backward recomputes primal values): the forward and
    # the inference function get their own, the backward keeps the adjoint's.
    fresh = copy_with_fresh_vars
    infer = fresh(a.primal[names.MAIN]).with_attr("global_symbol", names.FORWARD_INFER)
    mod = tvm.IRModule(
        {names.FORWARD: fresh(halves.forward), names.FORWARD_INFER: infer, names.BACKWARD: halves.backward}
    )
    mod = per_function(DedupAndSimplify(), mod)
    return dataclasses.replace(a, split=halves, halves=mod)


def _low_precision(a: Artifacts) -> Artifacts:
    """Precision as eager's: bfloat16/float16 math in float32; on a CPU, long float32 sums in
    float64 (TVM's CPU reductions add element after element; its GPU reductions are trees)."""
    halves = Float32Opmath()(a.halves)  # type: ignore[operator]  # module_pass: a pass constructor, unseen by mypy
    if a.device is not None and a.device.type == "cpu":
        halves = LongSumsInFloat64()(halves)  # type: ignore[operator]  # module_pass, as above
    return dataclasses.replace(a, halves=halves)


def _offload(a: Artifacts) -> Artifacts:
    """The chooser decides each GEMM (timing under ``auto``), the plan records it, the pass
    applies it: only the first step measures or touches a cache."""
    assert a.device is not None
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
    halves = ApplyOffloadPlan(plan)(a.halves)  # type: ignore[operator]  # module_pass: a pass constructor, unseen by mypy
    return dataclasses.replace(a, halves=halves, gemm_choices=plan.decisions)


def _convolutions(a: Artifacts) -> Artifacts:
    """On a CPU where the GEMMs go to a library, the convolutions go to PyTorch's (a GPU keeps
    TVM's). After ``low_precision``: under autocast a convolution then reads the float32 values
    that pass leaves it and rounds its result once, which gave ResNet's gradients what TVM's own
    kernels gave; reading the bfloat16-rounded operands, as eager does, put one weight gradient
    3.7x further from float32 than eager's (README, "Convolutions on PyTorch's kernels")."""
    assert a.device is not None
    if a.device.type != "cpu" or a.options.gemm_backend("cpu") is None:
        return a
    register_convs()
    return dataclasses.replace(a, halves=OffloadConvolutions()(a.halves))  # type: ignore[operator]  # module_pass


def _fast_math(a: Artifacts) -> Artifacts:
    return dataclasses.replace(a, halves=FastMathFloat32(a.halves)) if a.options.fast_math else a


def _build(a: Artifacts) -> Artifacts:
    """The part the first call needs (``a.first_part``), built now; the other when first needed."""
    assert a.device is not None and a.halves is not None
    device, options = a.device, a.options
    target = target_for(device, options.fp_contract)

    settings = (options.cpu_schedules, options.fuse, options.tuning_db)

    def build(part: tvm.IRModule, key: str) -> tuple[tvm.runtime.Executable, bool, str]:
        with stage_errors("build"):  # a part built later, inside a call, fails as the build stage
            exe, loaded, key = backend_build.compile_or_load(part, target, *settings, options.disk_cache, key=key)
            backend_build.load(exe, device)  # loads in this thread now: a failure is the build stage's
        return exe, loaded, key

    parts = Parts(a.halves, build, a.build_keys)  # keys kept with a compile result loaded from the disk cache
    # the other part's key, computed while this part builds, is stored with the compile result: a
    # later process builds or loads that part without lowering it first to find its key
    present = {gv.name_hint for gv in a.halves.get_global_vars()}
    later = [p for p, fs in FUNCTIONS.items() if p != a.first_part and p not in parts.keys and present.issuperset(fs)]
    with ThreadPoolExecutor(1, thread_name_prefix="tvmbridge-part-key") as pool:
        keys = {
            p: pool.submit(backend_build.executable_key(part_module(a.halves, p), target, *settings))
            for p in (later if backend_build.caches_executables(options.disk_cache) else [])
        }
        parts.get(a.first_part)
        parts.keys.update({p: k.result() for p, k in keys.items()})
    if device.type == "cpu" and a.random_sites and options.mask_kernel:
        kernel_works()  # builds and checks the mask kernel now, not on the first call
    return dataclasses.replace(a, parts=parts, build_keys=parts.keys)


def _adjoint(a: Artifacts) -> tvm.IRModule:
    assert a.gradient is not None
    return tvm.IRModule({names.ADJOINT: a.gradient.adjoint})


def _exported(a: Artifacts) -> torch.export.ExportedProgram | Deferred:
    """The decomposed program; deferred where the trace cache answered (made when read)."""
    assert a.traced is not None
    return a.traced.program


STAGES: tuple[Stage, ...] = (
    Stage("inputs", _inputs, lambda a: a.device, reads=(*INPUTS, "device"), writes=("device",)),
    Stage("trace", _trace, _exported, reads=(*INPUTS, "dynamic"), writes=("traced", "sizes", "trace_loaded")),
    Stage(
        "convert",
        _convert,
        lambda a: a.primal,
        reads=("traced", "options"),
        writes=("primal", "random_sites", "num_index_checks"),
    ),
    Stage("random", _random, lambda a: a.primal, reads=("primal",), writes=("primal",)),
    Stage("layer_norm", _layer_norm, lambda a: a.primal, reads=("primal",), writes=("primal",)),
    Stage("dedup", _dedup, lambda a: a.primal, reads=("primal",), writes=("primal",)),
    Stage(
        "gradient", _gradient, _adjoint, reads=("primal", "traced", "module"), writes=("grad_param_indices", "gradient")
    ),
    Stage("simplify", _simplify, _adjoint, reads=("gradient", "primal", "sizes"), writes=("gradient", "joint")),
    Stage("capture", _capture, lambda a: list(a.captures), reads=("joint", "options"), writes=("captures",)),
    Stage(
        "split",
        _split,
        lambda a: a.halves,
        reads=("gradient", "joint", "captures", "primal"),
        writes=("split", "halves"),
    ),
    Stage(
        "offload",
        _offload,
        lambda a: a.halves,
        reads=("halves", "options", "device", "sizes"),
        writes=("halves", "gemm_choices"),
    ),
    Stage("low_precision", _low_precision, lambda a: a.halves, reads=("halves", "device"), writes=("halves",)),
    Stage("convolutions", _convolutions, lambda a: a.halves, reads=("halves", "options", "device"), writes=("halves",)),
    Stage("fast_math", _fast_math, lambda a: a.halves, reads=("halves", "options"), writes=("halves",)),
    Stage(
        "build",
        _build,
        lambda a: a.parts,
        reads=("halves", "device", "options", "random_sites", "first_part", "build_keys"),
        writes=("parts", "build_keys"),
    ),
)
STAGE_NAMES = tuple(s.name for s in STAGES)
