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

from ..errors import ConversionError
from ..frontend.signature import canonical_call
from ..options import CompileOptions, with_overrides
from ..pipeline import CompiledModule, compile_training
from .function import TVMFunction, infer
from .masks import draw_masks

if TYPE_CHECKING:
    from .report import CaptureReport

_MISSING = object()


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device)


class Dispatcher:
    """Holds the compiled module and decides, per call, whether it applies."""

    def __init__(
        self, module: torch.nn.Module, compiled: CompiledModule, original_forward: Any, sample: tuple[tuple, dict]
    ) -> None:
        self.module = module
        self.sample = sample
        self.compiled = compiled
        self.original_forward = original_forward
        self.instance_forward: Any = _MISSING  # a forward set on the instance before dispatch
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
        masks = draw_masks(compiled.dropout_sites, compiled.device, compiled.options.mask_kernel)
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
        return capture_report(self.compiled, self.original_forward, self.module, args, kwargs)

    def fallback(self, args: tuple, kwargs: dict) -> Any:
        self.calls_fallback += 1
        return self.original_forward(*args, **kwargs)


def add_tvm_dispatch(
    module: torch.nn.Module,
    sample_inputs: Any,
    sample_kwargs: dict | None = None,
    options: CompileOptions | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """Compile ``module``'s forward and backward for the signature of the sample call and route
    matching calls through TVM. Returns ``module`` (patched in place).

    Args:
        sample_inputs: positional arguments of a sample call (a tensor or a tuple).
        sample_kwargs: keyword arguments of the sample call.
        options: a :class:`~tvmbridge.options.CompileOptions` (default: the defaults).
        **overrides: fields of the options to change for this call, e.g. ``capture="all"``,
            ``memory_budget=0.3``, ``fallback=True`` (on a compile failure, warn once and keep
            PyTorch), ``offload_matmul="torch"``; see ``CompileOptions`` for all of them.
    """
    opts = with_overrides(options, overrides)
    if getattr(module, "_tvm_dispatch", None) is not None:
        raise RuntimeError("module already has a TVM dispatch; call module.remove_tvm_dispatch() first")
    args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    try:
        compiled = compile_training(module, args, sample_kwargs, opts)
    except ConversionError as exc:
        if not opts.fallback:
            raise
        warnings.warn(f"tvmbridge: keeping PyTorch for {type(module).__name__}: {exc}", stacklevel=2)
        return module
    dispatcher = Dispatcher(module, compiled, module.forward, (args, dict(sample_kwargs or {})))
    dispatcher.instance_forward = module.__dict__.get("forward", _MISSING)
    module._tvm_dispatch = dispatcher
    module.forward = dispatcher
    module.remove_tvm_dispatch = types.MethodType(remove_tvm_dispatch, module)
    if opts.verbose:
        print(f"tvmbridge: {type(module).__name__}: {compiled.summary()}")
    return module


def remove_tvm_dispatch(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`add_tvm_dispatch`: the module's own forward again (a no-op without dispatch)."""
    dispatcher = getattr(module, "_tvm_dispatch", None)
    if dispatcher is None:
        return module
    original = dispatcher.instance_forward
    if original is _MISSING:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original
    module.__dict__.pop("remove_tvm_dispatch", None)
    module._tvm_dispatch = None
    return module
