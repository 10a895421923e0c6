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
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.forward_ad as fwAD
from torch._subclasses.fake_tensor import FakeTensor

from analysis.tensors import tensor_leaves

from ..backend.build import release_cached_memory
from ..errors import (
    AttributeWriteError,
    ConversionError,
    FallbackWarning,
    RecompileWarning,
    VerificationWarning,
    caller_stacklevel,
    module_name,
)
from ..frontend.call_state import replace_buffer
from ..frontend.signature import opaque_argument_reason
from ..options import CompileOptions, with_overrides
from .call_log import CallLog
from .checked import pytorchs_error, rng_states, run_checked, set_rng_states
from .compiled import CompiledModule
from .eager import EagerForward, update_targets
from .function import Call, CompiledCallError, TVMFunction, infer
from .guards import VALUE_CHECK_FAILED, Mismatch, call_flags_hold
from .locks import TRACING
from .random import draw
from .submodules import describe_submodules, remove_submodule_dispatch, submodules_report
from .variant_set import Outcome, Selection, VariantSet
from .variants import Fitted, Variant, empty_input
from .verify import GradientCheck

if TYPE_CHECKING:
    from .report import CaptureReport


def _tracing(args: tuple, kwargs: dict) -> bool:
    """Inside torch.compile/torch.export, or called with fake or meta tensors (a tracer, the
    analysis tools): the module's own forward is what they must see."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    return any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensor_leaves((args, kwargs)))


def _forward_ad_duals(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a tensor of the call or the module carries a forward-mode tangent (inside
    ``torch.autograd.forward_ad.dual_level``): the compiled Function has no ``jvp``."""
    if getattr(fwAD, "_current_level", 0) < 0:  # no dual level is open: no tangents (the usual case)
        return False
    tensors = [*tensor_leaves((args, kwargs)), *module.parameters(), *module.buffers()]
    return any(fwAD.unpack_dual(t).tangent is not None for t in tensors)


def _unfit_anywhere(module: torch.nn.Module, args: tuple, kwargs: dict) -> Mismatch | None:
    """What no compiled variant can run, whatever its signature."""
    if torch._C._len_torch_dispatch_stack():
        return Mismatch(
            "dispatch mode",
            "a TorchDispatchMode is active (a FLOP counter, a profiler, ...): it must see PyTorch's ops",
            recompile=False,
        )
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return Mismatch("torch.func", "called inside a torch.func transform (vmap, grad, ...)", recompile=False)
    if _forward_ad_duals(module, args, kwargs):
        return Mismatch("forward AD", "called with forward-mode AD tangents (dual tensors)", recompile=False)
    return None


class Dispatcher:
    """The module's ``forward`` while dispatched: the variant ``variant_set`` selects, a new one, or PyTorch."""

    def __init__(self, module: torch.nn.Module, sample: tuple[tuple, dict] | None, options: CompileOptions) -> None:
        self.module, self.sample, self.options = module, sample, options
        self.eager = EagerForward(module)
        self.submodule_of: str | None = None  # the module whose failed compile dispatched this one (``submodules``)
        self._reset()

    def _reset(self) -> None:
        original = self.eager.bound
        # the forward's signature: every binding of a call, and callers inspecting it (Trainer's columns)
        self.signature = inspect.signature(original)
        self.__signature__ = self.signature
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(self, attr, getattr(original, attr, None))
        self.variant_set = VariantSet(self.module, self.signature, self.options)
        self.log = CallLog()

    # --- pickling and copying: the copy recompiles on first use
    def __getstate__(self) -> dict:
        return {k: self.__dict__[k] for k in ("module", "sample", "options", "eager", "submodule_of")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    # --- what users and tests read
    @property
    def variants(self) -> tuple[Variant, ...]:
        return self.variant_set.variants

    @property
    def failures(self) -> dict[tuple, Mismatch]:
        return self.variant_set.failures

    @property
    def dynamic_failure(self) -> ConversionError | None:
        return self.variant_set.dynamic_failure

    @property
    def calls_tvm(self) -> int:
        return self.log.calls_tvm

    @property
    def calls_fallback(self) -> int:
        return self.log.calls_fallback

    @property
    def discarded(self) -> list[str]:
        return self.log.discarded

    @property
    def fallback_reasons(self) -> collections.Counter[str]:
        """How many calls PyTorch ran, by reason."""
        return self.log.fallback_reasons

    @property
    def last_decision(self) -> Variant | str:
        """The variant the last call ran, or why PyTorch ran it."""
        return self.log.last_decision

    @property
    def compiled(self) -> CompiledModule | None:
        """The first variant's compiled module (the sample's, when one was given)."""
        return self.variants[0].compiled if self.variants else None

    # --- compile ahead of a call
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
        variants = self.variant_set
        return variants.fitting(args, kwargs) or variants.compile_variant(
            args, kwargs, "compiled ahead of time", variants.dynamic_dims(args, kwargs)
        )

    def try_compile(self, *args: Any, **kwargs: Any) -> ConversionError | None:
        """Compile a variant for this call now unless one fits; its failure, or None. A failure is
        remembered as the first call's would be: calls like it run PyTorch without compiling again
        (the backend's graphs try this first, to split a graph at the ops that failed)."""
        with TRACING.reading():
            if _unfit_anywhere(self.module, args, kwargs) or empty_input(self.signature, args, kwargs):
                return None  # no variant would run it: the call itself says why
            key = self.variant_set.key(args, kwargs)
        if key in self.failures:
            return None
        try:
            self.precompile(*args, **kwargs)
        except ConversionError as exc:
            if self.variants or self.options.fallback:  # else each call raises, as a first call's failure does
                self.variant_set.remember_failure(key, exc)
            return exc
        return None

    # --- every call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager.active:
            return self.eager(*args, **kwargs)
        TRACING.wait_idle()  # another thread's trace patches every module call: let it finish
        if _tracing(args, kwargs):
            return self.eager(*args, **kwargs)
        with TRACING.reading():
            unfit = _unfit_anywhere(self.module, args, kwargs)
            choice = Selection.pytorch(unfit) if unfit is not None else self.variant_set.select(args, kwargs)
        if choice.outcome is Outcome.COMPILE:
            choice = self._compile_for_call(args, kwargs, choice.reason)
        if choice.outcome is Outcome.PYTORCH:
            assert choice.reason is not None  # Selection.pytorch names why
            return self.fallback(choice.reason, args, kwargs)
        variant, fitted = choice.variant, choice.fitted
        assert variant is not None and fitted is not None  # Selection.run: what runs
        self.log.ran_compiled(variant)  # explain() words it: no formatting on the hot path
        if fitted.sizes and variant.new_sizes_fill_pool(fitted.sizes):
            release_cached_memory()
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in fitted.tensors)
        if self.options.verify and variant.trust.needed(needs_grad):
            with variant.trust.lock:
                if variant.trust.needed(needs_grad):
                    return run_checked(self, variant, fitted, args, kwargs, needs_grad)
        rng = rng_states(variant.compiled.device) if variant.compiled.random_sites else None
        try:
            outs = self.execute(variant, fitted, needs_grad, rng, args, kwargs)
        except CompiledCallError as exc:  # PyTorch runs the call; its own errors (hooks, checkpoint) pass
            if rng is not None:
                set_rng_states(rng, variant.compiled.device)
            reason = self.discard(variant, args, kwargs, f"the compiled code failed while running ({exc})")
            return self.fallback(reason, args, kwargs)
        if not call_flags_hold(variant.compiled.traced, outs):  # PyTorch raises (or, where it does not, computes)
            if rng is not None:
                set_rng_states(rng, variant.compiled.device)
            self.log.compiled_call_refused(variant)
            return self.fallback(VALUE_CHECK_FAILED, args, kwargs)
        return self.finish(variant.compiled, fitted.tensors, outs)

    __call__ = torch.compiler.disable(__call__)  # opaque to dynamo: a parent compiles around it

    def _compile_for_call(self, args: tuple, kwargs: dict, reason: Mismatch | None) -> Selection:
        """A new variant for a call no variant fits, or why there is none (a call passing an object,
        a generation cache, fits none: told here, off the path of calls that fit)."""
        if (opaque := opaque_argument_reason(args, kwargs)) is not None:
            return Selection.pytorch(Mismatch("an object argument", opaque, recompile=False))
        key, refused = self.variant_set.refusal(args, kwargs, reason)
        if refused is not None:
            return Selection.pytorch(refused)
        if reason is not None and reason.structural and self.log.first_time(reason.key):
            warnings.warn(
                f"tvmbridge: {module_name(self.module)} compiles another variant for a call whose "
                f"arguments differ from the sample's: {reason.message}; if the caller always calls it this "
                "way, pass that call as the sample to compile once",
                RecompileWarning,
                stacklevel=caller_stacklevel(),
            )
        assert key is not None  # refusal gives the call's key, or why there is none
        try:
            return self.variant_set.compile_for(args, kwargs, key, reason)
        except ConversionError as exc:  # raised only where no variant compiled and fallback is off
            raise pytorchs_error(self, exc, args, kwargs)  # noqa: B904 - PyTorch's own where it refuses the call

    def execute(
        self,
        variant: Variant,
        fitted: Fitted,
        needs_grad: bool,
        rng: dict | None,
        args: tuple,
        kwargs: dict,
        check: GradientCheck | None = None,
    ) -> list[torch.Tensor]:
        """The compiled code on the call's tensors and freshly drawn random values: its flat outputs."""
        compiled, tensors, sizes = variant.compiled, fitted.tensors, fitted.sizes
        sites = [site.bind(sizes) for site in compiled.random_sites] if sizes else compiled.random_sites
        randoms = draw(sites, compiled.device, compiled.options.mask_kernel)
        if not needs_grad:
            return list(infer(compiled, tensors + randoms))
        written = compiled.written
        if written:  # the call writes them after the forward; the backward reads them as they were
            tensors = [t.clone() if i in written else t for i, t in enumerate(tensors)]
        eager = functools.partial(self.eager.outputs, compiled)
        discard = functools.partial(self.discard, variant, args, kwargs)
        return list(TVMFunction.apply(Call(compiled, randoms, eager, rng, sizes, check, discard), *tensors))

    def finish(self, compiled: CompiledModule, tensors: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
        """Updated buffers and inputs written back (the flags held), the module's own output rebuilt."""
        traced = compiled.traced
        n_user, n_updates = traced.num_user_outputs, traced.num_updates
        if n_updates:
            with torch.no_grad():
                for (what, target), new in zip(update_targets(compiled, tensors), outs[n_user : n_user + n_updates]):
                    if new.shape == target.shape and new.dtype == target.dtype:
                        target.copy_(new)
                    else:  # a buffer assigned anew with another shape, as the forward leaves it
                        replace_buffer(self.module, what.removeprefix("buffer "), new.detach())
        outs = list(outs)
        for i, j in traced.returned_inputs.items():  # an output that is an input is that input, as from PyTorch
            if outs[i].shape == tensors[j].shape and outs[i].dtype == tensors[j].dtype:
                outs[i] = tensors[j]
        return traced.output_of(outs)

    def discard(
        self, variant: Variant, args: tuple, kwargs: dict, message: str, warn: bool = True, bug: bool = True
    ) -> Mismatch:
        """Drop a variant that failed or disagreed with PyTorch (see ``VariantSet.discard``);
        ``bug``: whether the evidence shows the bridge wrong (else it could not be checked)."""
        reason = self.variant_set.discard(variant, args, kwargs, message, len(self.log.discarded))
        self.log.discarded_variant(reason)
        if warn:
            why = " (please report this: it is a bug of the bridge)" if bug else ""
            warnings.warn(
                f"tvmbridge: {module_name(self.module)}: {reason.message}; PyTorch runs these calls from now on{why}",
                VerificationWarning,
                stacklevel=caller_stacklevel(),
            )
        self.log.first_time(reason.key)
        return reason

    def fallback(self, reason: Mismatch, args: tuple, kwargs: dict) -> Any:
        """PyTorch runs the call, with a warning the first time for each reason."""
        self.log.fell_back(self.module, reason, self.options.warn_on_fallback)
        TRACING.wait_idle()
        out = self.eager(*args, **kwargs)
        self.variant_set.ran_pytorch(reason)
        return out

    def explain(self) -> str:
        """What the last call did and why, how often each path ran, and its submodules' own."""
        own = self.log.explain(module_name(self.module), self.variants)
        return own + submodules_report(self.module, self.variant_set.submodules)

    def report(self) -> CaptureReport:
        """Captured bytes, PyTorch's saved bytes for the same call, recompute cost (runs the
        original forward once for real to measure PyTorch)."""
        from .report import capture_report

        if self.sample is None:
            raise RuntimeError("report() runs the sample call: pass sample_inputs to add_tvm_dispatch")
        args, kwargs = self.sample
        return capture_report(self.compile(), self.eager, self.module, args, kwargs)

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
        except AttributeWriteError:  # the first call compiles, once PyTorch's has set what forward assigns
            pass
        except ConversionError as exc:
            if not opts.fallback:
                raise
            parts = dispatcher.variant_set.split_into_submodules(exc)
            if not parts:
                warnings.warn(
                    f"tvmbridge: keeping PyTorch for {type(module).__name__}: {exc}", FallbackWarning, stacklevel=2
                )
                return module
            key, _ = dispatcher.variant_set.refusal(*sample, None)
            if key is not None:  # calls like the sample run PyTorch without compiling again, unwarned
                dispatcher.log.first_time(dispatcher.variant_set.remember_failure(key, exc).key)
            warnings.warn(
                f"tvmbridge: keeping PyTorch for {type(module).__name__}'s own code: {exc}; its submodules run on "
                f"TVM by themselves: {describe_submodules(parts)}",
                FallbackWarning,
                stacklevel=2,
            )
    # plain attributes, which nn.Module's typed __setattr__ (tensors and submodules) does not name
    module._tvm_dispatch = dispatcher  # type: ignore[assignment]
    module.forward = dispatcher
    module.remove_tvm_dispatch = dispatcher.remove  # type: ignore[assignment]
    return module


def remove_tvm_dispatch(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`add_tvm_dispatch`: the module's own forward again (a no-op without dispatch)."""
    dispatcher = getattr(module, "_tvm_dispatch", None)
    if dispatcher is None:
        return module
    dispatcher.eager.reinstall()
    remove_submodule_dispatch(module)
    module.__dict__.pop("remove_tvm_dispatch", None)
    module._tvm_dispatch = None  # type: ignore[assignment]  # a plain attribute (see add_tvm_dispatch)
    return module


def dispatcher_or_none(module: torch.nn.Module) -> Dispatcher | None:
    """The dispatcher :func:`add_tvm_dispatch` installed on ``module``, or None."""
    dispatcher = getattr(module, "_tvm_dispatch", None)
    return dispatcher if isinstance(dispatcher, Dispatcher) else None


def dispatcher_of(module: torch.nn.Module) -> Dispatcher:
    """The dispatcher :func:`add_tvm_dispatch` installed on ``module`` (``module._tvm_dispatch``)."""
    dispatcher = dispatcher_or_none(module)
    if dispatcher is None:
        raise ValueError(f"{type(module).__name__} has no TVM dispatch (add_tvm_dispatch)")
    return dispatcher
