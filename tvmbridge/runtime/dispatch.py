"""``add_tvm_dispatch``: run a module's forward and backward through TVM where the compiled code fits.

The module's ``forward`` is replaced by a :class:`Dispatcher`. It keeps compiled variants
(``variants``), one per call signature the module has seen (shapes, dtypes, keywords, train or
eval mode, attribute values), each with guards (``guards``) that say which calls it fits. A call
runs the variant that fits it; a call none fits compiles one more (up to ``cache_size_limit``);
a call no compiled code can fit (hooks on submodules, a dispatch mode, an empty tensor,
a failed compile, a full cache) runs the original forward with a
:class:`~tvmbridge.errors.FallbackWarning` naming the reason (once per reason;
``warn_on_fallback=False`` silences it). ``module._tvm_dispatch.explain()`` says what happened.

The call reads the module's parameters and buffers afresh every time (they are inputs of the
compiled code), writes the buffers the module updates (BatchNorm's running statistics), checks
the embeddings' index-range flags, and is opaque to ``torch.compile`` (a graph break).
A dispatched module can be deep-copied, pickled and saved: the copy recompiles on first use.
"""
from __future__ import annotations

import collections
import functools
import inspect
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.utils.stateless import _reparametrize_module

from analysis.tensors import tensor_leaves

from ..backend.build import release_cached_memory
from ..backend.gemm_choice import summary as gemm_summary
from ..errors import ConversionError, FallbackWarning, RecompileWarning, VerificationWarning, caller_stacklevel
from ..frontend.export import AutocastState
from ..frontend.outputs import flatten_output
from ..options import CompileOptions, with_overrides
from ..pipeline import SHARED_CACHE, CompiledModule, compile_training
from .function import Call, CompiledCallError, TVMFunction, infer
from .guards import Mismatch
from .locks import TRACING
from .checked import rng_states, run_checked, set_rng_states
from .random import draw
from .variants import (Fitted, Variant, call_key, changed_dims, describe_dims, empty_input,
                       marked_dims)
from .verify import GradientCheck

if TYPE_CHECKING:
    from .report import CaptureReport

def _dims_key(dims: dict[int, frozenset[int]]) -> frozenset:
    return frozenset((i, d) for i, ds in dims.items() for d in ds)


def _tracing(args: tuple, kwargs: dict) -> bool:
    """Inside torch.compile/torch.export, or called with fake or meta tensors (a tracer, the
    analysis tools): the module's own forward is what they must see."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    return any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensor_leaves((args, kwargs)))


class Dispatcher:
    """The module's ``forward`` while dispatched: the compiled variants, the guards that pick
    one for each call, the compile of a new variant, the fallback."""

    def __init__(self, module: torch.nn.Module, sample: tuple[tuple, dict] | None, options: CompileOptions) -> None:
        self.module = module
        self.sample = sample
        self.options = options
        self.forward_fn = type(module).forward  # the class's forward, bound at each call
        self.instance_forward: Any = module.__dict__.get("forward")  # a forward set on the instance
        self._reset()

    def _reset(self) -> None:
        self.variants: tuple[Variant, ...] = ()
        self.failures: dict[tuple, Mismatch] = {}  # call_key -> why compiling it failed
        original = self.instance_forward if self.instance_forward is not None else self.forward_fn.__get__(self.module)
        # the module's own forward signature, for every binding of a call (the guard's, the trace's) and
        # for callers that inspect ``module.forward`` (Trainer drops the columns forward does not name)
        self.signature = inspect.signature(original)
        self.__signature__ = self.signature
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(self, attr, getattr(original, attr, None))
        self.calls_tvm = 0
        self.calls_fallback = 0
        self.fallback_reasons: collections.Counter[str] = collections.Counter()
        self.last_decision: Variant | str = "not called yet"
        self._last = 0  # the variant the last compiled call ran: tried first
        self.dynamic_failure: ConversionError | None = None  # why the last symbolic compile failed
        self._failed_dynamic: set[frozenset] = set()  # dims whose symbolic compile failed: not retried
        self._warned: set[str] = set()
        self.discarded: list[str] = []  # why variants were dropped (failed, or disagreed with PyTorch)
        self._dynamic_off = False  # a symbolic variant was discarded: compile exact shapes only
        self._lock = threading.Lock()  # counters and the warned set
        self._eager = threading.local()

    # --- pickling and copying: the copy recompiles on first use
    def __getstate__(self) -> dict:
        keep = ("module", "sample", "options", "forward_fn", "instance_forward")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    @property
    def compiled(self) -> CompiledModule | None:
        """The first variant's compiled module (the sample's, when one was given)."""
        return self.variants[0].compiled if self.variants else None

    # --- compile
    def compile(self) -> CompiledModule:
        """The compiled module for the sample call (compiled now if it is not yet)."""
        if self.sample is None:
            if not self.variants:
                raise RuntimeError("nothing compiled yet: call the module, or pass sample_inputs to add_tvm_dispatch")
            return self.variants[0].compiled
        args, kwargs = self.sample
        return self.precompile(*args, **kwargs).compiled

    def precompile(self, *args: Any, **kwargs: Any) -> Variant:
        """Compile a variant for this call now (ahead of time: e.g. in eval mode as well as in
        train mode), unless one fits it already. A failure raises ``ConversionError``."""
        for variant in self.variants:
            if variant.fit(self.module, self.signature, args, kwargs)[1] is None:
                return variant
        return self._compile_variant(args, kwargs, "compiled ahead of time", self._dynamic_dims(args, kwargs))

    def try_compile(self, *args: Any, **kwargs: Any) -> ConversionError | None:
        """Compile a variant for this call now unless one fits; its failure, or None. A failure is
        remembered as the first call's would be: calls like it run PyTorch without compiling again
        (the backend's graphs try this first, to split a graph at the ops that failed)."""
        with TRACING.reading():
            if self._unfit_anywhere(args, kwargs) or empty_input(self.signature, args, kwargs):
                return None  # no variant would run it: the call itself says why
            key = call_key(self.signature, args, kwargs, self.module)
        if key in self.failures:
            return None
        try:
            self.precompile(*args, **kwargs)
        except ConversionError as exc:
            if self.variants or self.options.fallback:  # else each call raises, as a first call's failure does
                self._remember_failure(key, exc)
            return exc
        return None

    def _remember_failure(self, key: tuple, exc: ConversionError) -> Mismatch:
        self.failures[key] = Mismatch(f"compile failed {len(self.failures)}",
                                      f"compiling a variant for this call failed: {exc}", recompile=False)
        return self.failures[key]

    def _compile_variant(self, args: tuple, kwargs: dict, why: str,
                         dynamic: dict[int, frozenset[int]] | None = None) -> Variant:
        with TRACING.writing():
            for variant in self.variants:  # another thread may have compiled it meanwhile
                if variant.fit(self.module, self.signature, args, kwargs)[1] is None:
                    return variant
            compiled = None
            if dynamic:
                try:
                    compiled = compile_training(self.module, args, kwargs, self.options, dynamic=dynamic,
                                                cache=SHARED_CACHE)
                    why += f"; symbolic in {describe_dims(compiled.traced)}"
                except ConversionError as exc:  # exact shapes then: slower to cover, never wrong
                    self.dynamic_failure = exc
                    self._failed_dynamic.add(_dims_key(dynamic))
                    why += f"; a symbolic compile failed ({exc}), compiled for this shape"
            if compiled is None:
                compiled = compile_training(self.module, args, kwargs, self.options, cache=SHARED_CACHE)
            if "reused" in compiled.compile_seconds:
                why += "; the compile of an identical graph reused"
            variant = Variant.create(self.module, self.signature, compiled, (args, kwargs), why)
            self.variants = (*self.variants, variant)
        if self.options.verbose:
            print(f"tvmbridge: {type(self.module).__name__} variant {len(self.variants)} ({variant.label}; {why}): "
                  f"{compiled.summary()}")
        return variant

    def _dynamic_dims(self, args: tuple, kwargs: dict) -> dict[int, frozenset[int]] | None:
        """Which dims of the call's tensors to compile symbolically: those the user marked, or
        (``dynamic="auto"``) those in which the call differs from a variant of its kind, unless a
        symbolic compile of this module failed before."""
        choice = self.options.dynamic
        if choice is False or self._dynamic_off:
            return None
        if isinstance(choice, dict):
            dims = marked_dims(self.signature, args, kwargs, choice)
        else:
            dims = next((d for v in reversed(self.variants) if (d := changed_dims(v, self.signature, args, kwargs))),
                        None)
        return None if dims is None or _dims_key(dims) in self._failed_dynamic else dims

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
        if getattr(self._eager, "active", False):
            return self.original_forward(*args, **kwargs)
        TRACING.wait_idle()  # another thread's trace patches every module call: let it finish
        if _tracing(args, kwargs):
            return self.original_forward(*args, **kwargs)
        with TRACING.reading():
            reason = self._unfit_anywhere(args, kwargs)
            variant = fitted = None
            if reason is None:
                variant, fitted, reason = self._select(args, kwargs)
        if variant is None and reason is not None and not reason.recompile:
            return self._fallback(reason, args, kwargs)
        if variant is None:
            variant, fitted, reason = self._compile_for_call(args, kwargs, reason)
            if variant is None:
                return self._fallback(reason, args, kwargs)
        with self._lock:
            self.calls_tvm += 1
            variant.calls += 1
        self.last_decision = variant  # explain() words it: no formatting on the hot path
        if fitted.sizes and variant.new_sizes_fill_pool(fitted.sizes):
            release_cached_memory()
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in fitted.tensors)
        if self.options.verify and variant.trust.needed(needs_grad):
            return run_checked(self, variant, fitted, args, kwargs, needs_grad)
        rng = rng_states(variant.compiled.device) if variant.compiled.random_sites else None
        try:
            outs = self._execute(variant, fitted, needs_grad, rng, args, kwargs)
        except CompiledCallError as exc:  # PyTorch runs the call; its own errors (hooks, checkpoint) pass
            if rng is not None:
                set_rng_states(rng, variant.compiled.device)
            reason = self.discard(variant, args, kwargs, f"the compiled code failed while running ({exc})")
            return self._fallback(reason, args, kwargs)
        return self._finish(variant.compiled, fitted.tensors, outs)

    __call__ = torch.compiler.disable(__call__)  # opaque to dynamo: a parent compiles around it

    def _unfit_anywhere(self, args: tuple, kwargs: dict) -> Mismatch | None:
        """What no compiled variant can run, whatever its signature."""
        if torch._C._len_torch_dispatch_stack():
            return Mismatch("dispatch mode", "a TorchDispatchMode is active (a FLOP counter, a profiler, ...): "
                            "it must see PyTorch's ops", recompile=False)
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return Mismatch("torch.func", "called inside a torch.func transform (vmap, grad, ...)", recompile=False)
        return None

    def _select(self, args: tuple, kwargs: dict) -> tuple[Variant | None, list | None, Mismatch | None]:
        """The variant that fits the call (the last one used is tried first), with its tensors;
        else why the closest one does not (one whose call signature fits, if any)."""
        variants = self.variants
        if not variants:
            return None, None, None
        last = min(self._last, len(variants) - 1)
        closest = None
        for i in (last, *(j for j in range(len(variants)) if j != last)):
            fitted, reason, inputs_fit = variants[i].fit_detail(self.module, self.signature, args, kwargs)
            if reason is None:
                self._last = i
                return variants[i], fitted, None
            if not reason.recompile:  # hooks and the like: no other variant fits either
                return None, None, reason
            if closest is None or (inputs_fit and not closest[1]):
                closest = (reason, inputs_fit)
        return None, None, closest[0]

    def _compile_for_call(self, args: tuple, kwargs: dict,
                          reason: Mismatch | None) -> tuple[Variant | None, list | None, Mismatch | None]:
        """A new variant for a call no variant fits, or why there is none. A failure raises when
        nothing has compiled yet and ``fallback`` is off; later it warns and runs PyTorch."""
        try:
            with TRACING.reading():
                refused = empty_input(self.signature, args, kwargs)
                key = call_key(self.signature, args, kwargs, self.module)
        except ConversionError as exc:  # the call does not bind: PyTorch says how
            return None, None, Mismatch("signature", str(exc), recompile=False)
        refused = refused or self.failures.get(key)
        if refused is None and len(self.variants) >= self.options.cache_size_limit:
            refused = Mismatch("cache size limit", f"{len(self.variants)} variants compiled, the cache_size_limit; "
                               f"{reason.message if reason else 'this call'}: raise cache_size_limit to compile more",
                               recompile=False)
        if refused is not None:
            return None, None, refused
        if reason is not None and reason.structural and reason.key not in self._warned:
            self._warned.add(reason.key)
            warnings.warn(f"tvmbridge: {type(self.module).__name__} compiles another variant for a call whose "
                          f"arguments differ from the sample's: {reason.message}; if the caller always calls it this "
                          "way, pass that call as the sample to compile once", RecompileWarning,
                          stacklevel=caller_stacklevel())
        try:
            dynamic = self._dynamic_dims(args, kwargs)
            variant = self._compile_variant(args, kwargs, reason.message if reason else "first call", dynamic)
        except ConversionError as exc:
            if not self.variants and not self.options.fallback:
                raise
            return None, None, self._remember_failure(key, exc)
        with TRACING.reading():
            fitted, unfit, _ = variant.fit_detail(self.module, self.signature, args, kwargs)
        if unfit is not None:
            return None, None, unfit
        self._last = self.variants.index(variant)
        return variant, fitted, None

    def _execute(self, variant: Variant, fitted: Fitted, needs_grad: bool, rng: dict | None, args: tuple,
                 kwargs: dict, check: GradientCheck | None = None) -> list[torch.Tensor]:
        """The compiled code on the call's tensors and freshly drawn random values: its flat outputs."""
        compiled, tensors, sizes = variant.compiled, fitted.tensors, fitted.sizes
        sites = [site.bind(sizes) for site in compiled.random_sites] if sizes else compiled.random_sites
        randoms = draw(sites, compiled.device, compiled.options.mask_kernel)
        if not needs_grad:
            return list(infer(compiled, tensors + randoms))
        written = compiled.written
        if written:  # the call writes them after the forward; the backward reads them as they were
            tensors = [t.clone() if i in written else t for i, t in enumerate(tensors)]
        eager = functools.partial(self._eager_outputs, compiled)
        discard = functools.partial(self.discard, variant, args, kwargs)
        return list(TVMFunction.apply(Call(compiled, randoms, eager, rng, sizes, check, discard), *tensors))

    def _finish(self, compiled: CompiledModule, tensors: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
        """Index flags checked, updated buffers and inputs written back, the module's own output rebuilt."""
        traced = compiled.traced
        n_user, n_updates = traced.num_user_outputs, traced.num_updates
        for flag in outs[n_user + n_updates:]:
            if int(flag) != 1:
                raise IndexError("index out of range in self")
        if n_updates:
            with torch.no_grad():
                for (_, target), new in zip(self.update_targets(compiled, tensors), outs[n_user:n_user + n_updates]):
                    target.copy_(new)
        return traced.output_of(list(outs))

    def discard(self, variant: Variant, args: tuple, kwargs: dict, message: str, warn: bool = True) -> Mismatch:
        """Drop a variant that failed or disagreed with PyTorch: calls of its signature run PyTorch
        from now on (a symbolic one's failure turns symbolic compiles off for this module)."""
        try:
            key = call_key(self.signature, args, kwargs, self.module)
        except ConversionError:
            key = None
        reason = Mismatch(f"discarded {len(self.discarded)}", f"variant '{variant.label}' was discarded: {message}",
                          recompile=False)
        with self._lock:
            self.variants = tuple(v for v in self.variants if v is not variant)
            if key is not None:
                self.failures[key] = reason
            self.discarded.append(reason.message)
            self.last_decision = f"ran PyTorch: {reason.message}"
            self._dynamic_off = self._dynamic_off or variant.symbolic
        if warn:
            warnings.warn(f"tvmbridge: {type(self.module).__name__}: {reason.message}; PyTorch runs these calls "
                          "from now on (please report this: it is a bug of the bridge)", VerificationWarning,
                          stacklevel=caller_stacklevel())
        with self._lock:
            self._warned.add(reason.key)
        return reason

    def _eager_outputs(self, compiled: CompiledModule, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """PyTorch's forward on the given call and state tensors: the flat outputs, as the
        compiled code returns them (for a double backward)."""
        return flatten_output(self.eager_call(compiled, tensors)[0])[0]

    def eager_call(self, compiled: CompiledModule, tensors: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
        """PyTorch's forward on the given call and state tensors: its output, and the new values
        of the buffers and inputs it updates, in the compiled outputs' order (updated on clones,
        so they are not updated twice)."""
        traced = compiled.traced
        user = [t.clone() if i in traced.updated_inputs else t for i, t in enumerate(tensors[:traced.num_user_inputs])]
        pending = iter(user)
        leaves = [traced.constant_leaves[i] if i in traced.constant_leaves else next(pending)
                  for i in range(traced.in_spec.num_leaves)]
        args, kwargs = pytree.tree_unflatten(leaves, traced.in_spec)
        state = dict(zip(traced.state.names, tensors[traced.num_user_inputs:]))
        state.update({n: state[n].clone() for n in traced.updated_buffers})
        self._eager.active = True
        try:  # under the autocast the variant was traced under, whatever is in effect now; the module's
            # tensors swapped for these meanwhile; its forward alone (its own hooks run around this call)
            with TRACING.writing(), AutocastState.entered(traced.autocast, compiled.device.type), \
                    _reparametrize_module(self.module, state, tie_weights=True, strict=False):
                out = self.original_forward(*args, **kwargs)
        finally:
            self._eager.active = False
        return out, [state[n] for n in traced.updated_buffers] + [user[i] for i in traced.updated_inputs]

    def update_targets(self, compiled: CompiledModule, tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The tensors a call writes in place, named, in the compiled outputs' order."""
        traced = compiled.traced
        by_name = dict(zip(traced.state.names, tensors[traced.num_user_inputs:]))
        return ([(f"buffer {n}", by_name[n]) for n in traced.updated_buffers]
                + [(f"input {i}", tensors[i]) for i in traced.updated_inputs])

    def _fallback(self, reason: Mismatch, args: tuple, kwargs: dict) -> Any:
        with self._lock:
            self.calls_fallback += 1
            self.fallback_reasons[reason.message] += 1
            first = reason.key not in self._warned
            self._warned.add(reason.key)
        self.last_decision = f"ran PyTorch: {reason.message}"
        if first and self.options.warn_on_fallback:
            warnings.warn(f"tvmbridge: fell back to PyTorch for {type(self.module).__name__}: {reason.message}",
                          FallbackWarning, stacklevel=caller_stacklevel())
        TRACING.wait_idle()
        return self.original_forward(*args, **kwargs)

    # --- reporting
    def explain(self) -> str:
        """What the last call did and why, and how often each path ran."""
        last = self.last_decision
        if isinstance(last, Variant):
            number = f"variant {self.variants.index(last) + 1}" if last in self.variants else "a discarded variant"
            last = f"ran the compiled code ({number}: {last.label})"
        lines = [f"{type(self.module).__name__}: last call {last}",
                 f"calls: {self.calls_tvm} compiled, {self.calls_fallback} PyTorch"]
        for i, v in enumerate(self.variants, 1):
            lines.append(f"  variant {i} ({v.label}): {v.calls} calls, compiled in "
                         f"{v.compiled.compile_seconds.get('total', 0):.1f}s because: {v.why}; "
                         f"GEMMs: {gemm_summary(list(v.compiled.gemm_choices))}")
        lines += [f"  {n} x PyTorch: {reason}" for reason, n in self.fallback_reasons.most_common()]
        lines += [f"  discarded: {why}" for why in self.discarded]
        return "\n".join(lines)

    def report(self) -> CaptureReport:
        """Captured bytes, PyTorch's saved bytes for the same call, recompute cost (runs the
        original forward once for real to measure PyTorch)."""
        from .report import capture_report

        if self.sample is None:
            raise RuntimeError("report() runs the sample call: pass sample_inputs to add_tvm_dispatch")
        args, kwargs = self.sample
        return capture_report(self.compile(), self.original_forward, self.module, args, kwargs)

    def remove(self) -> torch.nn.Module:
        """Undo :func:`add_tvm_dispatch`: the module's own forward again."""
        return remove_tvm_dispatch(self.module)


def add_tvm_dispatch(
    module: torch.nn.Module,
    sample_inputs: Any = None,
    sample_kwargs: dict | None = None,
    options: CompileOptions | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """Route ``module``'s forward and backward through TVM. Returns ``module`` (patched in place).

    Each call runs a compiled variant whose guards fit it; a call none fits compiles a new one
    (other shapes, eval mode, other keywords; up to ``cache_size_limit``), or runs PyTorch with a
    warning where no compiled code can fit it (hooks on submodules, a dispatch mode, ...). A call
    under ``torch.autocast`` runs a variant traced under the same autocast (its casts compiled in).

    Args:
        sample_inputs: positional arguments of a sample call (a tensor or a tuple), compiled
            now; without a sample the first call compiles.
        sample_kwargs: keyword arguments of the sample call.
        options: a :class:`~tvmbridge.options.CompileOptions` (default: the defaults).
        **overrides: fields of the options to change for this call, e.g. ``capture="all"``,
            ``memory_budget=0.3``, ``fallback=True`` (on a compile failure, warn once and keep
            PyTorch), ``cache_size_limit=4``; see ``CompileOptions`` for all of them.
    """
    opts = with_overrides(options, overrides)
    if getattr(module, "_tvm_dispatch", None) is not None:
        raise RuntimeError("module already has a TVM dispatch; call module.remove_tvm_dispatch() first")
    sample = None
    if sample_inputs is not None or sample_kwargs:
        args = () if sample_inputs is None else sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
        sample = (args, dict(sample_kwargs or {}))
    dispatcher = Dispatcher(module, sample, opts)
    if sample is not None:
        try:
            dispatcher.compile()
        except ConversionError as exc:
            if not opts.fallback:
                raise
            warnings.warn(f"tvmbridge: keeping PyTorch for {type(module).__name__}: {exc}", FallbackWarning,
                          stacklevel=2)
            return module
    module._tvm_dispatch = dispatcher
    module.forward = dispatcher
    module.remove_tvm_dispatch = dispatcher.remove
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

