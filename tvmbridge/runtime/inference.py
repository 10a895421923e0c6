"""Inference on TVM: a whole model compiled forward-only, its weights bound as constants.

``compile_inference(model, sample_inputs)`` exports the model in eval mode (dropout gone,
BatchNorm on its running statistics), binds the parameters and buffers as constants so that
TVM folds what depends on weights alone (transposed weights, combined biases), combines the
parallel matmuls that read one input (attention's Q/K/V: ``CombineParallelMatmul``), and builds
with the same GEMM choices as training. The result is a snapshot: weights changed afterwards are
not seen (compile again). It takes and returns torch tensors, for the sample's shapes, dtypes
and device; any other call is refused with an error that says so. Compiled under
``torch.autocast``, autocast's casts are compiled in and calls must be made under it as well.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.utils._pytree as pytree
import tvm
from tvm import relax

from .. import names
from ..backend.build import materialize_non_finite_fills
from ..devices import on_torch_stream, tvm_device
from ..errors import ConversionError
from ..frontend.export import release_program
from ..frontend.signature import canonical_call
from ..options import CompileOptions, with_overrides
from ..pipeline import STAGE_NAMES, STAGES, Artifacts, Stage, run_stages
from ..pipeline.parts import INFER
from .function import to_torch, to_tvm
from .guards import autocast_mismatch, check_index_flags, default_dtype_mismatch
from .variants import input_guard_for


def _bind_weights(a: Artifacts) -> Artifacts:
    """Parameters and buffers as constants, folded; parallel matmuls combined; one function."""
    if a.random_sites:
        raise ConversionError(
            "bind",
            "the model draws random numbers in eval mode "
            f"({len(a.random_sites)} random ops); inference compiles deterministic models only",
        )
    assert a.primal is not None and a.traced is not None
    func = a.primal[names.MAIN]
    traced = a.traced
    state = traced.state.tensors(a.module)
    params = list(func.params)[traced.num_user_inputs :]
    binding = {p: tvm.runtime.tensor(t.detach().cpu().contiguous().numpy()) for p, t in zip(params, state)}
    mod = tvm.IRModule({names.MAIN: func})
    mod = tvm.transform.Sequential(
        [
            # one reshape of the hidden states for Q, K and V (the export flattens per linear), so
            # that their matmuls share a left operand; combined on weight variables: the pass does
            # not match constants
            relax.transform.EliminateCommonSubexpr(),
            relax.transform.CanonicalizeBindings(),
            relax.transform.CombineParallelMatmul(),
            relax.transform.BindParams(names.MAIN, binding),
            materialize_non_finite_fills(),
            relax.transform.FoldConstant(),
            relax.transform.CanonicalizeBindings(),
            relax.transform.DeadCodeElimination(),
        ]
    )(mod)
    infer = mod[names.MAIN].with_attr("global_symbol", names.FORWARD_INFER).without_attr("num_input")
    return dataclasses.replace(a, halves=tvm.IRModule({names.FORWARD_INFER: infer}))


def _stage(name: str) -> Stage:
    return STAGES[STAGE_NAMES.index(name)]


INFERENCE_STAGES: tuple[Stage, ...] = (
    _stage("inputs"),
    _stage("trace"),
    _stage("convert"),
    Stage(
        "bind",
        _bind_weights,
        lambda a: a.halves,
        reads=("random_sites", "primal", "traced", "module"),
        writes=("halves",),
    ),
    _stage("offload"),
    _stage("low_precision"),
    _stage("convolutions"),
    _stage("fast_math"),
    _stage("build"),
)


class InferenceModule:
    """The compiled forward: call it as the model (same signature), get the model's outputs."""

    def __init__(self, model: torch.nn.Module, artifacts: Artifacts, seconds: dict[str, float]) -> None:
        assert artifacts.traced is not None and artifacts.device is not None and artifacts.parts is not None
        self.signature = inspect.signature(model.forward)
        self.traced = artifacts.traced
        self.device = artifacts.device
        self.num_index_checks = artifacts.num_index_checks
        self.gemm_choices = artifacts.gemm_choices
        self.compile_seconds = seconds
        self.stages = artifacts.halves
        self.guard = input_guard_for(self.signature, artifacts.args, artifacts.kwargs)  # the sample's exact shapes
        self._vm = relax.VirtualMachine(artifacts.parts.get(INFER), tvm_device(self.device))
        self.default_dtype = torch.get_default_dtype()  # as traced, just before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = canonical_call(self.signature, args, kwargs)
        leaves, spec = pytree.tree_flatten(call)
        unfit = (
            self.guard.check(leaves, spec, call)
            or autocast_mismatch(self.traced.autocast, self.device.type)
            or default_dtype_mismatch(self.default_dtype)
        )
        if unfit is not None:
            raise ValueError(
                f"compile_inference: {unfit.message}; it runs calls of the sample's shapes, dtypes, values, "
                "autocast and default dtype only: compile again for this call"
            )
        tensors = [to_tvm(x) for x in leaves if isinstance(x, torch.Tensor)]
        with torch.no_grad(), on_torch_stream(self.device):
            result = self._vm[names.FORWARD_INFER](*tensors)
        outs = [to_torch(r) for r in (result if isinstance(result, (list, tuple, tvm.ir.Array)) else [result])]
        n_user = self.traced.num_user_outputs
        check_index_flags(outs[n_user : n_user + self.num_index_checks])
        return self.traced.output_of(outs)


def compile_inference(
    model: torch.nn.Module,
    sample_inputs: Any = (),
    sample_kwargs: dict | None = None,
    options: CompileOptions | None = None,
    **overrides: Any,
) -> InferenceModule:
    """Compile ``model``'s forward in eval mode for the sample's shapes (see the module docstring).
    ``options``/``overrides``: :class:`~tvmbridge.options.CompileOptions` fields (``offload_matmul``,
    ``fast_math``, ...); the model's train/eval mode is restored afterwards."""
    # the weights are bound into the module as constants: a disk cache entry would be the model's
    # size, and a key per state of its weights
    opts = with_overrides(options, overrides).replace(disk_cache=False)
    args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    was_training = model.training
    model.eval()
    try:
        start = Artifacts(module=model, args=args, kwargs=dict(sample_kwargs or {}), options=opts, first_part=INFER)
        done, _shown, seconds = run_stages(start, INFERENCE_STAGES)
        release_program(done.traced)
    finally:
        model.train(was_training)
    return InferenceModule(model, done, seconds)
