"""``add_tvm_dispatch``: run a module's forward and backward through TVM for one call signature.

The module's ``forward`` is replaced by a guard: a call whose signature matches the compiled one
(tensor shapes, dtypes, device, non-tensor arguments, parameter layout, training mode) runs the
compiled halves; any other call runs the original forward, unchanged.
"""
from __future__ import annotations

import inspect
import types
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from .convert import canonical_call
from .errors import ConversionError
from .function import TVMFunction, infer
from .passes.dropout import draw_masks
from .pipeline import TORCH_DTYPES, CompiledModule, compile_training

if TYPE_CHECKING:
    from .report import CaptureReport

_MISSING = object()


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device)


class Dispatcher:
    """Holds the compiled module and decides, per call, whether it applies."""

    def __init__(
        self, module: torch.nn.Module, compiled: CompiledModule, original_forward: Any,
        sample: tuple[tuple, dict], policy: str,
    ) -> None:
        self.module = module
        self.sample = sample
        self.policy = policy
        self.compiled = compiled
        self.original_forward = original_forward
        self.signature = inspect.signature(original_forward)
        traced = compiled.traced
        self.in_spec = traced.in_spec
        self.constants = traced.constant_leaves
        self.training = module.training
        self.params = [module.get_parameter(n) for n in traced.param_targets]
        self.param_keys = [(_tensor_key(p), p.requires_grad) for p in self.params]
        self.input_keys = [
            _tensor_key(t) for t in pytree.tree_leaves(canonical_call(self.signature, *sample))
            if isinstance(t, torch.Tensor)
        ]
        # Fast path, decided once: a call of n positional tensors with no keywords has the same
        # canonical form as the sample when the sample's leaves are exactly the first n
        # (positional-or-keyword) parameters, all tensors, and no constants.
        self.positional_fast = self._positional_form(sample)
        self.calls_tvm = 0
        self.calls_fallback = 0

    def _positional_form(self, sample: tuple[tuple, dict]) -> int | None:
        cargs, ckwargs = canonical_call(self.signature, *sample)
        params = list(self.signature.parameters.values())
        n = len(ckwargs)
        if cargs or self.constants or n > len(params):
            return None
        if list(ckwargs) != [p.name for p in params[:n]]:
            return None
        if any(p.kind != inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:n]):
            return None
        if not all(isinstance(v, torch.Tensor) for v in ckwargs.values()):
            return None
        # omitted trailing parameters must be ones the canonical form drops (defaults)
        if any(p.default is inspect.Parameter.empty for p in params[n:] if p.kind == p.POSITIONAL_OR_KEYWORD):
            return None
        return n

    def matches(self, leaves: list[Any], spec: pytree.TreeSpec) -> bool:
        if spec != self.in_spec or self.module.training != self.training:
            return False
        keys = [_tensor_key(x) for x in leaves if isinstance(x, torch.Tensor)]
        if keys != self.input_keys:
            return False
        for i, c in self.constants.items():
            if leaves[i] is not c and leaves[i] != c:
                return False
        return [(_tensor_key(p), p.requires_grad) for p in self.params] == self.param_keys

    def _fast_matches(self, args: tuple) -> bool:
        return (
            self.module.training == self.training
            and all(isinstance(a, torch.Tensor) for a in args)
            and [_tensor_key(a) for a in args] == self.input_keys
            and [(_tensor_key(p), p.requires_grad) for p in self.params] == self.param_keys
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == self.positional_fast and self._fast_matches(args):
            tensors = list(args)
        else:
            try:
                cargs, ckwargs = canonical_call(self.signature, args, kwargs)
            except ConversionError:
                return self.fallback(args, kwargs)
            leaves, spec = pytree.tree_flatten((cargs, ckwargs))
            if not self.matches(leaves, spec):
                return self.fallback(args, kwargs)
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        self.calls_tvm += 1
        compiled = self.compiled
        masks = draw_masks(compiled.dropout_sites, compiled.device, TORCH_DTYPES)
        if torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.params) or any(t.requires_grad for t in tensors)
        ):
            outs = TVMFunction.apply(compiled, masks, *tensors, *self.params)
        else:
            outs = infer(compiled, [*tensors, *self.params, *masks])
        return pytree.tree_unflatten(list(outs), compiled.traced.out_spec)

    def report(self) -> "CaptureReport":
        """Captured bytes, PyTorch's saved bytes for the same call, recompute cost (runs the
        original forward once for real to measure PyTorch)."""
        from .report import capture_report

        args, kwargs = self.sample
        return capture_report(self.compiled, self.original_forward, self.module, args, kwargs, self.policy)

    def fallback(self, args: tuple, kwargs: dict) -> Any:
        self.calls_fallback += 1
        return self.original_forward(*args, **kwargs)


def add_tvm_dispatch(
    module: torch.nn.Module,
    sample_inputs: Any,
    sample_kwargs: dict | None = None,
    *,
    capture: str = "min-cut",
    memory_budget: int | float | None = None,
    fallback: bool = False,
    offload_matmul: bool | str | None = None,
    fast_math: bool = True,
    cpu_schedules: bool = True,
    fuse: bool = True,
    verbose: bool = False,
) -> torch.nn.Module:
    """Compile ``module``'s forward and backward for the signature of the sample call and route
    matching calls through TVM. Returns ``module`` (patched in place).

    Args:
        sample_inputs: positional arguments of a sample call (a tensor or a tuple).
        sample_kwargs: keyword arguments of the sample call.
        capture: capture-set policy for the forward/backward split: ``"min-cut"`` (keep the
            fewest bytes, recompute only cheap ops) or ``"all"`` (keep everything the backward reads).
        memory_budget: with min-cut, bytes (int) or a fraction of the save-all bytes (float) to keep
            at most; more is recomputed (matmuls included) to meet it.
        fallback: on a conversion error, warn once and keep PyTorch instead of raising.
        offload_matmul: run dense matmuls in a GEMM library PyTorch ships, via
            ``call_pure_packed`` on zero-copy views: ``"auto"`` (or True; oneDNN's inner product
            for float32 weight-like matmuls, ``torch.matmul`` for the rest), ``"torch"``
            (``torch.matmul`` only, MKL on x86), ``"onednn"``, or False (TVM's own kernels).
            Default: ``"auto"`` on CPU, where untuned TVM matmuls are naive loops.
        fast_math: float32 only: vectorizable erf/exp/tanh (a few ulps from libm; see
            ``passes/fast_math.py``). Float64 is never affected.
        cpu_schedules: parallel/vectorized schedules for TVM's own CPU kernels (``cpu_schedule.py``).
        fuse: operator fusion (Relax ``FuseOps``/``FuseTIR``): elementwise chains and their
            neighbours become one kernel. Off only to measure what fusion buys.
        verbose: print a one-line summary of the compiled module.
    """
    if getattr(module, "_tvm_dispatch", None) is not None:
        raise RuntimeError("module already has a TVM dispatch; call module.remove_tvm_dispatch() first")
    args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    try:
        _check_devices(module, args, sample_kwargs)
        compiled = compile_training(
            module, args, sample_kwargs, capture=capture, memory_budget=memory_budget,
            offload_matmul=offload_matmul, fast_math=fast_math, cpu_schedules=cpu_schedules,
            fuse=fuse,
        )
    except ConversionError as exc:
        if not fallback:
            raise
        warnings.warn(f"tvmbridge: keeping PyTorch for {type(module).__name__}: {exc}", stacklevel=2)
        return module
    original = module.__dict__.get("forward", _MISSING)
    policy = capture if isinstance(capture, str) else getattr(capture, "__name__", "custom")
    dispatcher = Dispatcher(module, compiled, module.forward, (args, dict(sample_kwargs or {})), policy)
    module._tvm_dispatch = dispatcher
    module.forward = dispatcher

    def remove_tvm_dispatch(self: torch.nn.Module) -> torch.nn.Module:
        if original is _MISSING:
            self.__dict__.pop("forward", None)
        else:
            self.forward = original
        self.__dict__.pop("remove_tvm_dispatch", None)
        self._tvm_dispatch = None
        return self

    module.remove_tvm_dispatch = types.MethodType(remove_tvm_dispatch, module)
    if verbose:
        print(f"tvmbridge: {type(module).__name__}: {compiled.summary()}")
    return module


def _check_devices(module: torch.nn.Module, args: tuple, kwargs: dict | None) -> None:
    tensors = [x for x in pytree.tree_leaves((args, kwargs or {})) if isinstance(x, torch.Tensor)]
    tensors += list(module.parameters())
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ConversionError(
            "inputs", f"inputs and parameters are on different devices ({', '.join(sorted(map(str, devices)))}); "
            "move them to one device before add_tvm_dispatch"
        )
    for d in devices:
        if d.type not in ("cpu", "cuda"):
            raise ConversionError("inputs", f"device {d} is not supported by TVM dispatch (cpu, cuda, rocm)")
