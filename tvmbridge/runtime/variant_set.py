"""A dispatched module's compiled variants: which one a call runs, compiling a new one, and the
signatures that must not compile again (a failed compile, a discarded variant).

A call's outcome is a :class:`Selection`: run a variant on the fitted tensors, compile one for
the call, or run PyTorch, each with the reason that decided it.
"""

from __future__ import annotations

import enum
import inspect
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from analysis.tensors import tensor_leaves

from ..errors import AttributeWriteError, ConversionError, RecompileWarning, listed_names, module_name
from ..frontend.call_state import attribute_states
from ..options import CompileOptions
from ..pipeline.parts import INFER, TRAIN
from .compiled import CompiledModule, compile_training
from .guards import Mismatch
from .locks import TRACING
from .submodules import describe_submodules, dispatch_submodules, splits_into_submodules
from .variants import Fitted, Variant, call_key, changed_dims, describe_dims, empty_input, marked_dims


class Outcome(enum.Enum):
    RUN = "run"  # a compiled variant fits the call
    COMPILE = "compile"  # none fits, and one compiled for the call would
    PYTORCH = "pytorch"  # no compiled code can run the call


@dataclass(frozen=True)
class Selection:
    """What a call runs. ``reason``: for COMPILE, why no variant fits (None: nothing compiled
    yet); for PYTORCH, why nothing compiled can run the call."""

    outcome: Outcome
    variant: Variant | None = None
    fitted: Fitted | None = None
    reason: Mismatch | None = None

    @classmethod
    def run(cls, variant: Variant, fitted: Fitted) -> Selection:
        return cls(Outcome.RUN, variant, fitted)

    @classmethod
    def compile(cls, reason: Mismatch | None) -> Selection:
        return cls(Outcome.COMPILE, reason=reason)

    @classmethod
    def pytorch(cls, reason: Mismatch) -> Selection:
        return cls(Outcome.PYTORCH, reason=reason)


def first_part(module: torch.nn.Module, args: tuple, kwargs: dict) -> str:
    """The part (``pipeline.parts``) a call needs: training where it will need gradients (grad
    mode on and a parameter or an input requiring one, as the dispatcher decides per call),
    else inference."""
    if torch.is_grad_enabled() and (
        any(p.requires_grad for p in module.parameters()) or any(t.requires_grad for t in tensor_leaves((args, kwargs)))
    ):
        return TRAIN
    return INFER


STRUCTURAL_STAGES = ("trace", "convert")  # failures of the module's code and ops, not of a call's sizes


def _sizeless(key: tuple) -> tuple:
    """A call key without the sizes of the call's tensors (their rank kept): calls that differ
    from a failed one only in sizes fail the same way at the stages of ``STRUCTURAL_STAGES``."""
    spec, call, *rest = key
    return (spec, tuple((len(x[0]), *x[1:]) if x[0] != "value" else x for x in call), *rest)


def _dims_key(dims: dict[int, frozenset[int]]) -> frozenset:
    return frozenset((i, d) for i, ds in dims.items() for d in ds)


def _closer(fit: Any, than: Any) -> bool:
    """Whether ``fit`` is the nearer miss: its call arguments fit, and then, it differs only in a
    cache that was emptied (the forward fills it again: no compile needed)."""
    return (fit.inputs_fit, fit.reason.emptied) > (than.inputs_fit, than.reason.emptied)


RETRACES_SAID = 3  # identical graphs traced again before the warning: one is a state change, three a habit


class VariantSet:
    """The variants of one module, newest last; ``failures``: call keys that run PyTorch."""

    def __init__(self, module: torch.nn.Module, signature: inspect.Signature, options: CompileOptions) -> None:
        self.module, self.signature, self.options = module, signature, options
        self.variants: tuple[Variant, ...] = ()
        self.failures: dict[tuple, Mismatch] = {}  # call_key -> why compiling it failed, or its variant was dropped
        # structural failures by _sizeless key, once PyTorch ran the failed call fine (the call was valid)
        self.sizeless_failures: dict[tuple, Mismatch] = {}
        self.unconfirmed: dict[str, tuple] = {}  # failure's Mismatch.key -> its _sizeless key, until then
        # call keys whose trace assigned module attributes once -> (those attributes, what they held)
        self.deferred: dict[tuple, tuple[list[str], tuple | None] | None] = {}
        self.deferred_pending = False  # a call was deferred since the last call a variant ran
        self.last = 0  # the variant the last compiled call ran: tried first
        self.dynamic_failure: ConversionError | None = None  # why the last symbolic compile failed
        self.failed_dynamic: set[frozenset] = set()  # dims whose symbolic compile failed: not retried
        self.dynamic_off = False  # a symbolic variant was discarded: compile exact shapes only
        self.submodules: list[str] = []  # submodules dispatched by themselves after a compile failed (``submodules``)
        self.retraced = 0  # variants whose trace gave a graph compiled before: state that changed, not the graph
        self.lock = threading.Lock()

    def key(self, args: tuple, kwargs: dict) -> tuple:
        return call_key(self.signature, args, kwargs, self.module)

    def fitting(self, args: tuple, kwargs: dict) -> Variant | None:
        return next((v for v in self.variants if v.fit(self.module, self.signature, args, kwargs).ok), None)

    def select(self, args: tuple, kwargs: dict) -> Selection:
        """The variant that fits the call (the last one used is tried first), with its tensors;
        else why the closest one does not (one whose call arguments fit, if any)."""
        variants = self.variants
        if not variants:
            return Selection.compile(None)
        last = min(self.last, len(variants) - 1)
        closest = None
        for i in (last, *(j for j in range(len(variants)) if j != last)):
            fit = variants[i].fit(self.module, self.signature, args, kwargs)
            if fit.fitted is not None:
                self.last = i
                if self.deferred_pending:  # deferring helped (a cache filled): it may again, once emptied
                    self.deferred.pop(self.key(args, kwargs), None)
                    self.deferred_pending = False  # the call after a deferral only: a key costs a state walk
                return Selection.run(variants[i], fit.fitted)
            assert fit.reason is not None  # a fit has its tensors or a reason
            if not fit.reason.recompile:  # hooks and the like: no other variant fits either
                return Selection.pytorch(fit.reason)
            if closest is None or _closer(fit, closest):
                closest = fit
        assert closest is not None  # there are variants, and none fit
        return Selection.compile(closest.reason)

    def refusal(self, args: tuple, kwargs: dict, reason: Mismatch | None) -> tuple[tuple | None, Mismatch | None]:
        """The call's key, and why no variant may be compiled for it (an empty input, a failure
        remembered for its key, a full cache), or None."""
        try:
            with TRACING.reading():
                refused = empty_input(self.signature, args, kwargs)
                key = self.key(args, kwargs)
        except ConversionError as exc:  # the call does not bind: PyTorch says how
            return None, Mismatch("signature", str(exc), recompile=False)
        refused = refused or self.failures.get(key) or self.sizeless_failures.get(_sizeless(key))
        if refused is None and len(self.variants) >= self.options.cache_size_limit:
            refused = Mismatch(
                "cache size limit",
                f"{len(self.variants)} variants compiled, the cache_size_limit; "
                f"{reason.message if reason else 'this call'}: raise cache_size_limit to compile more",
                recompile=False,
            )
        return key, refused

    def compile_for(self, args: tuple, kwargs: dict, key: tuple, reason: Mismatch | None) -> Selection:
        """A new variant for a call no variant fits. A failure raises when nothing has compiled
        yet and ``fallback`` is off; else it is remembered and the call runs PyTorch."""
        if reason is not None and reason.emptied and key not in self.deferred:  # PyTorch's call fills it
            self.deferred[key] = None
            self.deferred_pending = True
            said = f"compiling deferred: {reason.message}; PyTorch runs this call"
            return Selection.pytorch(Mismatch("cache emptied", said, recompile=False))
        emptied = self.emptied_again(key)
        if emptied is not None:
            self.deferred_pending = True
            return Selection.pytorch(Mismatch("cache emptied", emptied, recompile=False))
        try:
            variant = self.compile_variant(
                args, kwargs, reason.message if reason else "first call", self.dynamic_dims(args, kwargs)
            )
        except AttributeWriteError as exc:  # once per key: traced again after PyTorch's call
            if self.deferred.get(key) is not None:  # traced before (not only deferred for an emptied cache)
                again = AttributeWriteError(exc.names, every_call=True, hint=exc.hint)
                if not self.variants and not self.options.fallback:
                    raise again from exc
                return Selection.pytorch(self.remember_failure(key, again))
            with TRACING.reading():
                self.deferred[key] = (exc.names, attribute_states(self.module, exc.names))
            self.deferred_pending = True
            return Selection.pytorch(Mismatch("attributes assigned", f"compiling deferred: {exc}", recompile=False))
        except ConversionError as exc:
            if not self.variants and not self.options.fallback:
                raise
            self.split_into_submodules(exc)
            return Selection.pytorch(self.remember_failure(key, exc))
        self.deferred.pop(key, None)  # deferring helped (a cache filled): it may again, once emptied
        with TRACING.reading():
            fit = variant.fit(self.module, self.signature, args, kwargs)
        if fit.fitted is None:
            assert fit.reason is not None  # a fit has its tensors or a reason
            return Selection.pytorch(fit.reason)
        self.last = self.variants.index(variant)
        return Selection.run(variant, fit.fitted)

    def emptied_again(self, key: tuple) -> str | None:
        """Why a deferred call is deferred again without a trace, or None: the attributes its
        trace assigned hold what they held then (a cache the forward fills, emptied again since
        PyTorch's call filled it: LeViT's attention biases, which ``train()`` clears; with one
        eval call between training phases every such call finds it empty). A forward that
        assigns on every call (a counter, ``self.last = y``) left them changed: traced again."""
        entry = self.deferred.get(key)
        if entry is None or entry[1] is None:
            return None
        names, states = entry
        with TRACING.reading():
            if attribute_states(self.module, names) != states:
                return None
        return (
            f"compiling deferred: {listed_names(names)} hold again what they held before PyTorch's call filled them "
            "(emptied since, as train() empties a cache); PyTorch runs this call"
        )

    def split_into_submodules(self, exc: ConversionError) -> list[str]:
        """After a compile failure, the module's submodules dispatched by themselves where the
        options and the failure allow it (``submodules``); their paths."""
        with self.lock:
            if not self.submodules and splits_into_submodules(self.module, self.options, exc):
                self.submodules = dispatch_submodules(self.module, self.options, module_name(self.module))
        return self.submodules

    def remember_failure(self, key: tuple, exc: ConversionError) -> Mismatch:
        said = f"compiling a variant for this call failed: {exc}"
        if self.submodules:
            said += f"; its submodules run on TVM by themselves: {describe_submodules(self.submodules)}"
        self.failures[key] = Mismatch(f"compile failed {len(self.failures)}", said, recompile=False)
        if exc.stage in STRUCTURAL_STAGES and not isinstance(exc, AttributeWriteError):
            self.unconfirmed[self.failures[key].key] = _sizeless(key)
        return self.failures[key]

    def ran_pytorch(self, reason: Mismatch) -> None:
        """PyTorch ran a call ``reason`` refused: where that was a structural compile failure, the
        call was valid (a call PyTorch rejects fails any trace at its sizes only), so calls that
        differ from it only in sizes are not traced again (an audio model at each new length)."""
        if self.unconfirmed and (sizeless := self.unconfirmed.pop(reason.key, None)) is not None:
            self.sizeless_failures[sizeless] = reason

    def compile_variant(
        self, args: tuple, kwargs: dict, why: str, dynamic: dict[int, frozenset[int]] | None = None
    ) -> Variant:
        with TRACING.writing():
            already = self.fitting(args, kwargs)  # another thread may have compiled it meanwhile
            if already is not None:
                return already
            compiled, said = self._compiled(args, kwargs, why, dynamic)
            variant = Variant.create(self.module, self.signature, compiled, (args, kwargs), said)
            misfit = variant.fit(self.module, self.signature, args, kwargs).reason if dynamic else None
            if misfit is not None:  # the trace kept a dim static (a range it checks): this shape then
                self.failed_dynamic.add(_dims_key(dynamic or {}))
                said = f"{why}; the symbolic compile does not fit this call ({misfit.message}), compiled for this shape"
                compiled, said = self._compiled(args, kwargs, said, None)
                variant = Variant.create(self.module, self.signature, compiled, (args, kwargs), said)
            self.variants = (*self.variants, variant)
        if self.options.verbose:
            print(
                f"tvmbridge: {module_name(self.module)} variant {len(self.variants)} ({variant.label}; {said}): "
                f"{compiled.summary()}"
            )
        return variant

    def _compiled(
        self, args: tuple, kwargs: dict, why: str, dynamic: dict[int, frozenset[int]] | None
    ) -> tuple[CompiledModule, str]:
        compiled = None
        part = first_part(self.module, args, kwargs)
        if dynamic:
            try:
                compiled = compile_training(
                    self.module, args, kwargs, self.options, dynamic=dynamic, reuse=True, first_part=part
                )
                why += f"; symbolic in {describe_dims(compiled.traced)}"
            except ConversionError as exc:  # exact shapes then: slower to cover, never wrong
                self.dynamic_failure = exc
                self.failed_dynamic.add(_dims_key(dynamic))
                why += f"; a symbolic compile failed ({exc}), compiled for this shape"
        if compiled is None:
            compiled = compile_training(self.module, args, kwargs, self.options, reuse=True, first_part=part)
        if "reused" in compiled.compile_seconds:
            self._note_retrace(why)
            why += "; the compile of an identical graph reused"
        return compiled, why

    def _note_retrace(self, why: str) -> None:
        """Said once, at the third variant whose trace gave a graph already compiled: state the
        guard checks changes from call to call without changing the graph, so every such call
        traces again and keeps one more variant (the trap a changing ``_flat_weights`` was)."""
        self.retraced += 1
        if self.retraced == RETRACES_SAID:
            warnings.warn(
                f"tvmbridge: {module_name(self.module)} was traced again {self.retraced} times into a graph it "
                f"had compiled before, the last time because {why}: each such call pays a trace and keeps one "
                "more variant. Keep that state unchanged between calls: a counter or flag the forward does not "
                "read belongs outside the module (every attribute of it is checked), a tensor can be a "
                "parameter or buffer (an input, not compiled in); if it is one already, please report this",
                RecompileWarning,
                stacklevel=6,
            )

    def dynamic_dims(self, args: tuple, kwargs: dict) -> dict[int, frozenset[int]] | None:
        """Which dims of the call's tensors to compile symbolically: those the user marked, or
        (``dynamic="auto"``) those in which the call differs from a variant of its kind, unless a
        symbolic compile of this module failed before."""
        choice = self.options.dynamic
        if choice is False or self.dynamic_off:
            return None
        if isinstance(choice, dict):
            dims = marked_dims(self.signature, args, kwargs, choice)
        else:
            dims = next(
                (d for v in reversed(self.variants) if (d := changed_dims(v, self.signature, args, kwargs))), None
            )
        return None if dims is None or _dims_key(dims) in self.failed_dynamic else dims

    def discard(self, variant: Variant, args: tuple, kwargs: dict, message: str, number: int) -> Mismatch:
        """Drop a variant that failed or disagreed with PyTorch: calls of its signature run PyTorch
        from now on (a symbolic one's failure turns symbolic compiles off for this module)."""
        try:
            key: Any = self.key(args, kwargs)
        except ConversionError:
            key = None
        reason = Mismatch(f"discarded {number}", f"variant '{variant.label}' was discarded: {message}", recompile=False)
        with self.lock:
            self.variants = tuple(v for v in self.variants if v is not variant)
            if key is not None:
                self.failures[key] = reason
            self.dynamic_off = self.dynamic_off or variant.symbolic
        return reason
