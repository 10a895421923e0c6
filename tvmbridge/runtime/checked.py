"""A variant's first calls, run next to PyTorch and compared (see :mod:`.verify`).

PyTorch runs first, on the very tensors of the call (an error there is the user's error, raised
as PyTorch raises it), then the generator is rewound and the compiled code runs, drawing the same
random values. Outputs and updated buffers are compared now; gradients at the call's first
backward. A disagreement discards the variant and this call returns PyTorch's result.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ..errors import AttributeWriteError, ConversionError, VerificationWarning, caller_stacklevel, module_name
from ..frontend.outputs import labelled_output_tensors
from .eager import update_targets
from .function import CompiledCallError
from .guards import VALUE_CHECK_FAILED, call_flags_hold
from .verify import Discrepancy, GradientCheck, own_inputs, rejudged_outputs, same_computation, worst

if TYPE_CHECKING:
    from ..frontend.export import TracedModule
    from .dispatch import Dispatcher
    from .variants import Fitted, Variant


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The generator states a call may draw from (CPU, and the call's CUDA device)."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def computed_precision(traced: TracedModule) -> torch.dtype | None:
    """The dtype the call's values are rounded to at their coarsest, for the tolerance: autocast's
    where one was on, else the least precise float dtype the traced graph computes in (a float64
    model's float32 norm); the outputs' own dtypes are taken with it (``verify.compare``)."""
    return traced.autocast.dtype if traced.autocast is not None else traced.coarsest_float


def run_checked(
    dispatcher: Dispatcher, variant: Variant, fitted: Fitted, args: tuple, kwargs: dict, needs_grad: bool
) -> Any:
    """Run the call both ways; return the compiled result where it agrees, PyTorch's otherwise."""
    compiled = variant.compiled
    traced = compiled.traced
    before = rng_states(compiled.device)
    inputs = own_inputs(fitted.tensors, traced.num_user_inputs)
    try:  # what PyTorch saves for its backward bypasses saved-tensor hooks (checkpoint's count the call's own)
        with torch.set_grad_enabled(needs_grad), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            eager_out, eager_state = dispatcher.eager.call(compiled, inputs)
    except Exception:
        # PyTorch refuses this call (a bad index, an assertion): so must we; the variant stays
        # unchecked for its next call (discarded, one bad batch sent its signature to PyTorch)
        raise
    after = rng_states(compiled.device)
    paths = labelled_output_tensors(eager_out)[0]
    precision = computed_precision(traced)
    n_user = traced.num_user_outputs
    check = None
    if needs_grad:
        differentiable = [i < n_user and d for i, d in enumerate(compiled.differentiable)]
        leaves = [paths[i][1] if d else None for i, d in enumerate(differentiable)]
        # run at the first backward, only if a gradient is outside the tolerance
        again = functools.partial(_eager_again, dispatcher, compiled, inputs, paths, differentiable, precision, before)
        check = GradientCheck(
            leaves,
            inputs,
            variant.tensor_names(),
            lambda found: _gradients_checked(dispatcher, variant, args, kwargs, found),
            precision,
            reference=functools.partial(again, full_precision=True),
            shaken=functools.partial(again, full_precision=False),
        )
    set_rng_states(before, compiled.device)
    found: str | None = None  # what went wrong, if anything
    flags_hold = True
    try:
        outs = dispatcher.execute(variant, fitted, needs_grad, before, args, kwargs, check)
    except CompiledCallError as exc:  # PyTorch's result stands
        found = f"the compiled code failed on its first call ({exc})"
    else:
        flags_hold = call_flags_hold(traced, outs)
    if found is None and flags_hold:
        pairs = [(where, outs[i], want) for i, (where, want) in enumerate(paths)]
        pairs += [
            (label, outs[n_user + j], want)
            for j, ((label, _), want) in enumerate(zip(update_targets(compiled, fitted.tensors), eager_state))
        ]
        found = _outputs_disagree(dispatcher, compiled, inputs, before, pairs, precision)
    if not flags_hold:  # a value check failed (not this variant's call): PyTorch's result stands, unjudged
        dispatcher.log.compiled_call_refused(variant)
        dispatcher.log.fell_back(dispatcher.module, VALUE_CHECK_FAILED, dispatcher.options.warn_on_fallback)
    elif found is None:
        variant.trust.outputs_agreed(needs_grad)
        return dispatcher.finish(compiled, fitted.tensors, outs)
    else:
        dispatcher.discard(variant, args, kwargs, found)
    set_rng_states(after, compiled.device)
    with torch.no_grad():
        for (_, tensor), new in zip(update_targets(compiled, fitted.tensors), eager_state):
            tensor.copy_(new)
    return eager_out


def _outputs_disagree(
    dispatcher: Dispatcher,
    compiled: Any,
    inputs: list[torch.Tensor],
    rng: dict[str, torch.Tensor],
    pairs: list,
    precision: torch.dtype | None,
) -> str | None:
    """How the first call's outputs disagree with PyTorch's (beyond the call's own noise), or None."""
    discrepancy = worst(pairs, precision)
    if discrepancy is not None and discrepancy.excess != float("inf"):
        discrepancy = _outputs_rejudged(dispatcher, compiled, inputs, rng, pairs, precision)
    return None if discrepancy is None else f"its outputs disagreed with PyTorch's on its first call: {discrepancy}"


def _outputs_rejudged(
    dispatcher: Dispatcher,
    compiled: Any,
    inputs: list[torch.Tensor],
    rng: dict[str, torch.Tensor],
    pairs: list[tuple[str, Any, Any]],
    precision: torch.dtype | None,
) -> Discrepancy | None:
    """The outputs and updated buffers judged again against PyTorch's in full precision
    (``verify.rejudged_outputs``), from the call's generator state ``rng`` (the generator is left
    as it was); as they were judged where that run fails."""
    now = rng_states(compiled.device)
    set_rng_states(rng, compiled.device)
    try:
        with torch.no_grad():
            out, state = dispatcher.eager.call(compiled, inputs, full_precision=True)
        exact = [t for _, t in labelled_output_tensors(out)[0]] + list(state)
    except Exception:  # noqa: BLE001 - no reference: judged at the dtype's tolerance
        exact = []
    finally:
        set_rng_states(now, compiled.device)
    if len(exact) != len(pairs):
        return worst(pairs, precision)
    return rejudged_outputs(pairs, exact, precision)


def _eager_again(
    dispatcher: Dispatcher,
    compiled: Any,
    inputs: list[torch.Tensor],
    paths: list[tuple[str, torch.Tensor]],
    differentiable: list[bool],
    precision: torch.dtype | None,
    rng: dict[str, torch.Tensor],
    full_precision: bool,
) -> list[torch.Tensor | None] | None:
    """PyTorch's differentiable outputs of the same call again, from the call's generator state
    ``rng`` (the same dropout masks; the generator is left as it was), for the gradient check
    (``GradientCheck``): in full precision (autocast off; without autocast, float32 in float64),
    the values to judge against, or else at the call's precision from every float input one
    rounding away (:func:`one_rounding_away`), a sample of rounding's own spread. None where it
    cannot serve: PyTorch fails so, or its outputs are not the same computation's
    (``verify.same_computation``: a random op that draws differently by dtype, say)."""
    now = rng_states(compiled.device)
    set_rng_states(rng, compiled.device)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            tensors = inputs if full_precision else one_rounding_away(inputs)
            out, _ = dispatcher.eager.call(compiled, tensors, full_precision=full_precision)
    except Exception:  # noqa: BLE001 - no reference: the check stays at the dtype's tolerance
        return None
    finally:
        set_rng_states(now, compiled.device)
    ref_paths = labelled_output_tensors(out)[0]
    if len(ref_paths) != len(paths):
        return None
    pairs = [(where, ref.to(want.dtype), want) for (where, want), (_, ref) in zip(paths, ref_paths)]
    if not same_computation(pairs, precision):
        return None
    return [ref_paths[i][1] if d else None for i, d in enumerate(differentiable)]


def one_rounding_away(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each float tensor times ``1 +- eps`` of its dtype elementwise (signs from a private,
    fixed-seed generator: the global one is not drawn from), differentiably, so that gradients
    reach the tensors themselves; infinities (an additive attention mask's) and other tensors as
    they are."""
    generators: dict[torch.device, torch.Generator] = {}
    out = []
    for t in tensors:
        if not t.is_floating_point() or t.numel() == 0:
            out.append(t)
            continue
        gen = generators.setdefault(t.device, torch.Generator(t.device).manual_seed(0))
        signs = torch.randint(0, 2, t.shape, generator=gen, device=t.device).to(t.dtype) * 2 - 1
        moved = t + t * (signs * torch.finfo(t.dtype).eps)
        out.append(torch.where(torch.isfinite(t), moved, t))  # -inf * -eps would add +inf: a NaN
    return out


# how many backwards of a variant may leave its gradient check unsettled (a call too
# ill-conditioned to tell a bug from rounding) before the variant is discarded
UNSETTLED_CHECKS = 3


def _gradients_checked(
    dispatcher: Dispatcher, variant: Variant, args: tuple, kwargs: dict, found: Discrepancy | None
) -> None:
    """Trust the variant's gradients, check them again on its next call (this backward used
    PyTorch's: ``found`` unsettled, a few times at most), or discard the variant."""
    trust = variant.trust
    if found is None:
        trust.gradients = True
    elif found.unsettled and trust.unsettled + 1 < UNSETTLED_CHECKS:
        trust.unsettled += 1
        _unsettled(
            dispatcher,
            variant,
            f"its gradients could not be checked on this call, too ill-conditioned to tell rounding from "
            f"a bug ({found}); this backward used PyTorch's gradients and its next call is checked again",
        )
    elif found.unsettled:
        message = (
            f"its gradients disagreed with PyTorch's on each of its first {UNSETTLED_CHECKS} backwards, "
            f"in calls too ill-conditioned to tell rounding from a bug (the last: {found})"
        )
        dispatcher.discard(variant, args, kwargs, message, bug=False)
    else:
        dispatcher.discard(
            variant, args, kwargs, f"its gradients disagreed with PyTorch's on its first backward: {found}"
        )


def _unsettled(dispatcher: Dispatcher, variant: Variant, message: str) -> None:
    """A backward whose gradient check could not decide used PyTorch's gradients: counted with
    the reasons PyTorch ran, warned of once per variant."""
    dispatcher.log.pytorch_gradients(f"gradients of variant '{variant.label}': {message}")
    if dispatcher.log.first_time(f"unsettled {id(variant)}") and dispatcher.options.warn_on_fallback:
        warnings.warn(
            f"tvmbridge: {module_name(dispatcher.module)}: variant '{variant.label}': {message}",
            VerificationWarning,
            stacklevel=caller_stacklevel(),
        )


def pytorchs_error(dispatcher: Dispatcher, failure: ConversionError, args: tuple, kwargs: dict) -> Exception:
    """The error to raise for a first call that cannot compile (no variant, fallback off): PyTorch's
    own where PyTorch refuses the call too (a float64 batch into a float32 model, a wrong width,
    integer features), noting the bridge's failure; else that failure. So a bad input gets the
    error the call gets without the bridge, not the bridge's account of failing to trace it. The
    probe leaves the generator and the module's buffers as they were (a BatchNorm's statistics)."""
    if isinstance(failure, AttributeWriteError):  # PyTorch's call sets what the forward assigns
        return failure
    device = next((t.device for t in dispatcher.module.buffers()), torch.device("cpu"))
    before = rng_states(device)
    buffers = [(b, b.detach().clone()) for b in dispatcher.module.buffers()]
    try:
        with torch.no_grad():
            dispatcher.eager(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever PyTorch raises is the answer
        exc.add_note(f"tvmbridge: compiling {module_name(dispatcher.module)} for this call failed too: {failure}")
        return exc
    finally:
        set_rng_states(before, device)
        with torch.no_grad():
            for buffer, value in buffers:
                if buffer.shape == value.shape:
                    buffer.copy_(value)
    return failure
