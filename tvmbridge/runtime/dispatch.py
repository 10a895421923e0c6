"""``add_tvm_dispatch``: run a module's forward and backward through TVM where the compiled code fits.

The module's ``forward`` is replaced by a :class:`Dispatcher`. Every call is either run by the
compiled code, because every guard (``guards``) says it fits (the call, the module's state, its
attributes, submodules and hooks, no autocast), or by the original forward, with a
:class:`~tvmbridge.errors.FallbackWarning` naming the reason (once per reason;
``warn_on_fallback=False`` silences it). ``module._tvm_dispatch.explain()`` says what happened.

The call reads the module's parameters and buffers afresh every time (they are inputs of the
compiled code), writes the buffers the module updates (BatchNorm's running statistics), checks
the embeddings' index-range flags, and is opaque to ``torch.compile`` (a graph break).
A dispatched module can be deep-copied, pickled and saved: the copy recompiles on first use.
"""
from __future__ import annotations

import collections
import inspect
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from analysis.tensors import tensor_leaves

from ..errors import ConversionError, FallbackWarning
from ..frontend.signature import canonical_call
from ..options import CompileOptions, with_overrides
from ..pipeline import CompiledModule, compile_training
from .function import Call, TVMFunction, infer
from .guards import InputGuard, Mismatch, StateGuard
from .random import draw

if TYPE_CHECKING:
    from .report import CaptureReport

def _leaf_labels(cargs: tuple, ckwargs: dict) -> list[str]:
    """``arg 0``, ``hidden_states``, ``past[1]``...: a name for every leaf of a canonical call."""
    paths = pytree.tree_flatten_with_path((cargs, ckwargs))[0]
    labels = []
    for path, _ in paths:
        head, rest = path[0], path[1:]
        name = f"arg {rest[0].idx}" if head.idx == 0 else str(rest[0].key)
        labels.append(name + pytree.keystr(rest[1:]))
    return labels


def _positional_form(signature: inspect.Signature, args: tuple, kwargs: dict, leaves: list[Any]) -> int | None:
    """``n`` when the compiled call is ``f(t_1, ..., t_n)`` with tensors: binding a call of ``n``
    tensors and no keywords then gives the compiled structure, so the guard can skip binding."""
    params = list(signature.parameters.values())
    n = len(args)
    if kwargs or n > len(params) or len(leaves) != n or not all(isinstance(a, torch.Tensor) for a in args):
        return None
    if any(p.kind != inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:n]):
        return None
    # the parameters after them must be ones the canonical form drops (non-tensor defaults)
    if any(p.default is inspect.Parameter.empty or isinstance(p.default, torch.Tensor)
           for p in params[n:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)):
        return None
    return n


def _tracing(args: tuple, kwargs: dict) -> bool:
    """Inside torch.compile/torch.export, or called with fake or meta tensors (a tracer, the
    analysis tools): the module's own forward is what they must see."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    return any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensor_leaves((args, kwargs)))


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside torch and tvmbridge."""
    import os
    import sys

    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


class Dispatcher:
    """The module's ``forward`` while dispatched: guards, the compiled call, the fallback."""

    def __init__(self, module: torch.nn.Module, sample: tuple[tuple, dict], options: CompileOptions) -> None:
        self.module = module
        self.sample = sample
        self.options = options
        self.forward_fn = type(module).forward  # the class's forward, bound at each call
        self.instance_forward: Any = module.__dict__.get("forward")  # a forward set on the instance
        self._reset()

    def _reset(self) -> None:
        self.compiled: CompiledModule | None = None
        self.signature = inspect.signature(self.forward_fn.__get__(self.module))
        self.calls_tvm = 0
        self.calls_fallback = 0
        self.fallback_reasons: collections.Counter[str] = collections.Counter()
        self.last_decision = "not called yet"
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._eager = threading.local()

    # --- pickling and copying: the copy recompiles on first use
    def __getstate__(self) -> dict:
        keep = ("module", "sample", "options", "forward_fn", "instance_forward")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    # --- compile
    def compile(self) -> CompiledModule:
        """Compile for the sample call (done by ``add_tvm_dispatch``, or on first use of a copy)."""
        with self._lock:
            if self.compiled is None:
                args, kwargs = self.sample
                installed = self.module.__dict__.get("forward") is self  # a copy compiling lazily
                if installed:  # tracing must see the module's own forward
                    self._uninstall()
                try:
                    compiled = compile_training(self.module, args, kwargs, self.options)
                finally:
                    if installed:
                        self.module.forward = self
                cargs, ckwargs = canonical_call(self.signature, args, kwargs)
                leaves, spec = pytree.tree_flatten((cargs, ckwargs))
                self.input_guard = InputGuard(leaves, spec, _leaf_labels(cargs, ckwargs), (cargs, ckwargs),
                                              _positional_form(self.signature, args, kwargs, leaves))
                n_user = compiled.traced.num_user_inputs
                with_grad = {i - n_user for i in compiled.grad_param_indices if i >= n_user}
                self.state_guard = StateGuard(self.module, compiled.traced.state, with_grad)
                self.compiled = compiled
        return self.compiled

    def _compile_on_first_use(self) -> CompiledModule | None:
        """A copy compiles when first called; with ``fallback=True`` a failure keeps PyTorch."""
        if getattr(self, "failed", None) is not None:
            return None
        try:
            return self.compile()
        except ConversionError as exc:
            if not self.options.fallback:
                raise
            self.failed = exc
            warnings.warn(f"tvmbridge: keeping PyTorch for {type(self.module).__name__}: {exc}", FallbackWarning,
                          stacklevel=_caller_stacklevel())
            return None

    def _uninstall(self) -> None:
        if self.instance_forward is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.instance_forward

    def original_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.instance_forward is not None:
            return self.instance_forward(*args, **kwargs)
        return self.forward_fn(self.module, *args, **kwargs)

    # --- every call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self._eager, "active", False) or _tracing(args, kwargs):
            return self.original_forward(*args, **kwargs)
        compiled = self.compiled if self.compiled is not None else self._compile_on_first_use()
        if compiled is None:
            return self.original_forward(*args, **kwargs)
        tensors, reason = self._fit(compiled, args, kwargs)
        if reason is not None:
            return self._fallback(reason, args, kwargs)
        with self._lock:
            self.calls_tvm += 1
        self.last_decision = "ran the compiled code"
        return self._run(compiled, tensors)

    __call__ = torch.compiler.disable(__call__)  # opaque to dynamo: a parent compiles around it

    def _fit(self, compiled: CompiledModule, args: tuple, kwargs: dict) -> tuple[list | None, Mismatch | None]:
        """The call's tensors then the state's, if every guard passes; else the first reason."""
        if torch.is_autocast_enabled(compiled.device.type):
            return None, Mismatch("autocast", "autocast is on; mixed precision runs PyTorch until the bridge supports it")
        if torch._C._len_torch_dispatch_stack():
            return None, Mismatch("dispatch mode", "a TorchDispatchMode is active (a FLOP counter, a profiler, ...): "
                                  "it must see PyTorch's ops")
        if self.input_guard.fast(args, kwargs):
            user, reason = list(args), None
        else:
            user, reason = self._bind(args, kwargs)
        if reason is None:
            reason = self.state_guard.check(self.module)
        if reason is not None:
            return None, reason
        state, reason = self.state_guard.tensors(self.module)
        if reason is None and torch._C._functorch.peek_interpreter_stack() is not None:
            reason = Mismatch("torch.func", "called inside a torch.func transform (vmap, grad, ...)")
        if reason is not None:
            return None, reason
        return user + state, None

    def _bind(self, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor] | None, Mismatch | None]:
        try:
            cargs, ckwargs = canonical_call(self.signature, args, kwargs)
        except ConversionError as exc:
            return None, Mismatch("signature", str(exc))
        leaves, spec = pytree.tree_flatten((cargs, ckwargs))
        reason = self.input_guard.check(leaves, spec, (cargs, ckwargs))
        return ([x for x in leaves if isinstance(x, torch.Tensor)], None) if reason is None else (None, reason)

    def _run(self, compiled: CompiledModule, tensors: list[torch.Tensor]) -> Any:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        rng = self._rng_states(compiled) if needs_grad and compiled.random_sites else None
        randoms = draw(compiled.random_sites, compiled.device, compiled.options.mask_kernel)
        if needs_grad:
            outs = TVMFunction.apply(Call(compiled, randoms, self._eager_outputs, rng), *tensors)
        else:
            outs = infer(compiled, tensors + randoms)
        traced = compiled.traced
        n_user, n_state = traced.num_user_outputs, len(traced.updated_buffers)
        for flag in outs[n_user + n_state:]:
            if int(flag) != 1:
                raise IndexError("index out of range in self")
        if n_state:
            by_name = dict(zip(traced.state.names, tensors[traced.num_user_inputs:]))
            with torch.no_grad():
                for name, new in zip(traced.updated_buffers, outs[n_user:n_user + n_state]):
                    by_name[name].copy_(new)
        return pytree.tree_unflatten(list(outs[:n_user]), traced.out_spec)

    @staticmethod
    def _rng_states(compiled: CompiledModule) -> dict[str, torch.Tensor]:
        states = {"cpu": torch.get_rng_state()}
        if compiled.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(compiled.device)
        return states

    def _eager_outputs(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """PyTorch's forward on the given call and state tensors (buffers it updates are cloned,
        so they are not updated twice): the flat outputs, as the compiled code returns them."""
        traced = self.compiled.traced
        user = iter(tensors[:traced.num_user_inputs])
        leaves = [traced.constant_leaves[i] if i in traced.constant_leaves else next(user)
                  for i in range(traced.in_spec.num_leaves)]
        args, kwargs = pytree.tree_unflatten(leaves, traced.in_spec)
        state = dict(zip(traced.state.names, tensors[traced.num_user_inputs:]))
        state.update({n: state[n].clone() for n in traced.updated_buffers})
        self._eager.active = True
        try:
            out = torch.func.functional_call(self.module, state, args, kwargs, tie_weights=True, strict=False)
        finally:
            self._eager.active = False
        return pytree.tree_leaves(out)

    def _fallback(self, reason: Mismatch, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            self.calls_fallback += 1
            self.fallback_reasons[reason.message] += 1
            first = reason.key not in self._warned
            self._warned.add(reason.key)
        self.last_decision = f"ran PyTorch: {reason.message}"
        if first and self.options.warn_on_fallback:
            warnings.warn(f"tvmbridge: fell back to PyTorch for {type(self.module).__name__}: {reason.message}",
                          FallbackWarning, stacklevel=_caller_stacklevel())
        return self.original_forward(*args, **kwargs)

    # --- reporting
    def explain(self) -> str:
        """What the last call did and why, and how often each path ran."""
        lines = [f"{type(self.module).__name__}: last call {self.last_decision}",
                 f"calls: {self.calls_tvm} compiled, {self.calls_fallback} PyTorch"]
        lines += [f"  {n} x PyTorch: {reason}" for reason, n in self.fallback_reasons.most_common()]
        return "\n".join(lines)

    def report(self) -> CaptureReport:
        """Captured bytes, PyTorch's saved bytes for the same call, recompute cost (runs the
        original forward once for real to measure PyTorch)."""
        from .report import capture_report

        args, kwargs = self.sample
        return capture_report(self.compile(), self.original_forward, self.module, args, kwargs)

    def remove(self) -> torch.nn.Module:
        """Undo :func:`add_tvm_dispatch`: the module's own forward again."""
        return remove_tvm_dispatch(self.module)


def add_tvm_dispatch(
    module: torch.nn.Module,
    sample_inputs: Any,
    sample_kwargs: dict | None = None,
    options: CompileOptions | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """Compile ``module``'s forward and backward for the signature of the sample call and route
    calls that fit through TVM. Returns ``module`` (patched in place).

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
    dispatcher = Dispatcher(module, (args, dict(sample_kwargs or {})), opts)
    try:
        compiled = dispatcher.compile()
    except ConversionError as exc:
        if not opts.fallback:
            raise
        warnings.warn(f"tvmbridge: keeping PyTorch for {type(module).__name__}: {exc}", FallbackWarning, stacklevel=2)
        return module
    module._tvm_dispatch = dispatcher
    module.forward = dispatcher
    module.remove_tvm_dispatch = dispatcher.remove
    if opts.verbose:
        print(f"tvmbridge: {type(module).__name__}: {compiled.summary()}")
    return module


def remove_tvm_dispatch(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`add_tvm_dispatch`: the module's own forward again (a no-op without dispatch)."""
    dispatcher = getattr(module, "_tvm_dispatch", None)
    if dispatcher is None:
        return module
    dispatcher._uninstall()
    module.__dict__.pop("remove_tvm_dispatch", None)
    module._tvm_dispatch = None
    return module

