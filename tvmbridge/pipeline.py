"""The compile pipeline: trace -> convert -> passes -> gradient -> split -> build.

Each step takes and returns a value that can be printed or drawn; all of them are kept in
``CompiledModule.stages`` (Relax modules print with ``.show()``).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import tvm
from tvm import relax

from . import build as build_mod
from . import rng
from .capture import CapturePolicy, capture_all, choose_captures, op_flops
from .convert import TracedModule, to_relax, trace
from .errors import ConversionError
from .passes import build_adjoint, decompose_for_training, dedup, externalize_dropout, simplify
from .passes.dropout import DropoutSite
from .passes.fast_math import fast_math_float32
from .passes.offload import offload_matmuls
from .split import SplitResult, joint_graph, split

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
}


@dataclass
class CompiledModule:
    """A module compiled for one call signature: both halves, and everything needed to call them."""

    traced: TracedModule
    device: torch.device
    dropout_sites: list[DropoutSite]
    grad_param_indices: list[int]  # primal params (user inputs, then params) that get a gradient
    split: SplitResult
    forward_vm: relax.VirtualMachine
    backward_vm: relax.VirtualMachine
    compile_seconds: dict[str, float]
    stages: dict[str, Any] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def output_meta(self) -> list[tuple[list[int], torch.dtype]]:
        """Shape and dtype of each output (for the zero gradient of an unused output)."""
        fields = self.split.forward.ret_ty.fields[: self.num_outputs]
        return [([int(d) for d in ty.shape], TORCH_DTYPES[str(ty.dtype)]) for ty in fields]

    @property
    def num_outputs(self) -> int:
        return self.split.num_outputs

    def captured_bytes(self) -> int:
        """Bytes of the forward values TVM keeps for the backward (masks not included)."""
        return sum(self.split.joint.nodes[c].nbytes for c in self.split.captures)

    def mask_bytes(self) -> int:
        """Bytes of the dropout masks the backward reads (kept alongside the captures)."""
        joint = self.split.joint
        names = [joint.params[i] for i in self.split.backward_param_indices]
        return sum(joint.nodes[n].nbytes for n in names if n.startswith("dropout_mask"))

    def save_all_bytes(self) -> int:
        joint = self.split.joint
        return sum(joint.nodes[n].nbytes for n in capture_all(joint))

    def recompute_flops(self) -> float:
        joint = self.split.joint
        return sum(op_flops(joint, joint.nodes[n]) for n in self.split.recomputed)

    def summary(self) -> str:
        t = self.compile_seconds
        return (
            f"{len(self.split.captures)} captured values ({self.captured_bytes() / 2**20:.2f} MiB), "
            f"{len(self.split.recomputed)} recomputed, {len(self.dropout_sites)} dropout masks; "
            f"compile {t.get('total', 0):.1f}s (build {t.get('build', 0):.1f}s)"
        )


def _grad_indices(traced: TracedModule, func: relax.Function, module: torch.nn.Module) -> list[int]:
    n_user = len(traced.user_input_names)
    idx = [i for i in range(n_user) if str(func.params[i].ty.dtype).startswith(("float", "bfloat"))]
    params = dict(module.named_parameters())
    for j, name in enumerate(traced.param_targets):
        if params[name].requires_grad:
            idx.append(n_user + j)
    return idx


def compile_training(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    capture: str | CapturePolicy = "min-cut",
    memory_budget: int | float | None = None,
    device: torch.device | None = None,
    offload_matmul: bool | str | None = None,
    fast_math: bool = True,
    cpu_schedules: bool = True,
    fuse: bool = True,
) -> CompiledModule:
    """Compile forward and backward of ``module`` for the signature of ``(args, kwargs)``."""
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    stages: dict[str, Any] = {}

    def mark(name: str, since: float) -> float:
        now = time.perf_counter()
        times[name] = now - since
        return now

    traced = trace(module, args, kwargs)
    stages["exported"] = traced.exported
    t = mark("trace", t0)
    mod = to_relax(traced)
    stages["relax"] = mod
    t = mark("convert", t)
    try:
        func, sites = externalize_dropout(mod["main"])
        mod = tvm.IRModule({"main": func})
        mod = relax.transform.CanonicalizeBindings()(mod)
        stages["dropout"] = mod
        mod = decompose_for_training(mod)
        stages["layer_norm"] = mod
        mod = dedup(mod)
        stages["dedup"] = mod
    except ConversionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConversionError("passes", f"{type(exc).__name__}: {exc}") from exc
    primal = mod["main"]
    grad_idx = _grad_indices(traced, primal, module)
    grad = build_adjoint(primal, grad_idx)
    adj_mod = simplify(tvm.IRModule({"main_adjoint": grad.adjoint}))
    grad.adjoint = adj_mod["main_adjoint"]
    stages["adjoint"] = adj_mod
    t = mark("gradient", t)

    joint = joint_graph(grad, _count_primal(primal, grad.adjoint))
    captures = choose_captures(joint, capture, memory_budget)
    halves = split(grad, joint, captures)
    # "forward_infer": the primal function alone (outputs, no captures), for calls that need no
    # gradient (no_grad, or nothing requires grad): nothing is kept for a backward that never comes.
    infer = relax.utils.copy_with_new_vars(primal).with_attr("global_symbol", "forward_infer")
    fwd_mod = dedup(tvm.IRModule({"forward": halves.forward, "forward_infer": infer}))
    bwd_mod = simplify(dedup(tvm.IRModule({"backward": halves.backward})))
    stages["forward"], stages["backward"] = fwd_mod, bwd_mod
    t = mark("split", t)

    if device is None:
        device = next((a.device for a in traced_tensors(args, kwargs)), torch.device("cpu"))
    target = build_mod.target_for(device)
    if offload_matmul is None:
        offload_matmul = device.type == "cpu"
    if offload_matmul:
        backend = "auto" if offload_matmul is True else offload_matmul
        fwd_mod, bwd_mod = offload_matmuls(fwd_mod, backend), offload_matmuls(bwd_mod, backend)
    if fast_math:
        fwd_mod, bwd_mod = fast_math_float32(fwd_mod), fast_math_float32(bwd_mod)
    stages["forward_built"], stages["backward_built"] = fwd_mod, bwd_mod
    fwd_exec = build_mod.compile_module(fwd_mod, target, cpu_schedules, fuse)
    bwd_exec = build_mod.compile_module(bwd_mod, target, cpu_schedules, fuse)
    fvm = build_mod.load(fwd_exec, device)
    bvm = build_mod.load(bwd_exec, device)
    if device.type == "cpu" and sites:
        rng.available()  # builds and checks the mask kernel now, not on the first call
    t = mark("build", t)
    times["total"] = t - t0
    return CompiledModule(
        traced=traced, device=device, dropout_sites=sites, grad_param_indices=grad_idx,
        split=halves, forward_vm=fvm, backward_vm=bvm, compile_seconds=times, stages=stages,
    )


def _count_primal(primal: relax.Function, adjoint: relax.Function) -> int:
    """How many leading adjoint bindings are the primal ones (``Gradient`` emits them first;
    simplification may have dropped dead ones, never reordered them)."""
    names = [b.var.name for b in primal.body.blocks[0].bindings]
    adj = [b.var.name for b in adjoint.body.blocks[0].bindings]
    i = j = 0
    while i < len(names) and j < len(adj):
        if names[i] == adj[j]:
            j += 1
        i += 1
    return j


def traced_tensors(args: tuple, kwargs: dict | None) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
    return [x for x in leaves if isinstance(x, torch.Tensor)]
