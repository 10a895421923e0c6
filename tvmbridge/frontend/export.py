"""Trace one call of a module with ``torch.export``, decomposed to core ATen.

The call is first put in canonical form (``signature``); its non-tensor leaves are bound as
constants (:class:`FlatCall`). The module's state (parameters and buffers, each tied tensor once)
becomes ordinary inputs after the call's tensors, swapped in for the call
(``call_state.swapped_state``): nothing is compiled in as a constant, so ``load_state_dict``, an
optimizer step or a replaced ``Parameter`` is seen by the next call. Buffers the call updates in
place (BatchNorm's running statistics in train mode) come back as extra outputs, after the
module's own. What the export learned is kept in :class:`TracedModule` for the guard and the
runtime.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..errors import AttributeWriteError, ConversionError, describe
from .attribute_reads import AttributeReads
from .call_state import (
    AutocastState,
    ModuleState,
    assigning_hooks,
    changed_attributes,
    module_attributes,
    restore_attributes,
)
from .decompositions import decomposition_table
from .digest import program_digest
from .flat_call import FlatCall
from .host_random import host_random_seen
from .mixed_dtypes import make_dtype_mixing_explicit
from .module_hooks import hook_snapshot, hooks_refusal, restore_hooks
from .noop_casts import noop_casts_kept
from .outputs import OutputLayout, unflatten_output
from .program_facts import (
    check_outputs,
    cloned_inputs,
    coarsest_float,
    constant_outputs,
    copied_outputs,
    grad_sources,
    input_dims,
    inputs_without_grad_path,
    mutations_as_outputs,
    ranges,
    reassigned_buffers,
    returned_inputs,
    updated_tensors,
    user_input_specs,
)
from .signature import canonical_call, opaque_argument_reason
from .traced_layouts import keep_traced_layouts
from .untraced_autograd import untraced_autograd_seen
from .value_branches import (
    UnsampledBranchError,
    branches_as_sampled,
    quiet_value_reads,
    sampled_branches_refusal,
    unguarded_decision,
)
from .value_hints import data_dependent_hint, value_free_hints, value_read_named


class Deferred:
    """A decomposed program made on first use, once: a trace the trace cache answered needs it
    only where a later stage reads the graph itself (a compile whose result is not cached). Once
    the compile is done it is released (:func:`release_program`): it would hold the module and
    the sample call, and a module changed since (train/eval) would trace another program."""

    def __init__(self, make: Callable[[], ExportedProgram]) -> None:
        self._make: Callable[[], ExportedProgram] | None = make
        self._value: ExportedProgram | BaseException | None = None
        self._lock = threading.Lock()

    def get(self) -> ExportedProgram:
        with self._lock:
            if self._value is None:
                make, self._make = self._make, None  # made once: a failure is kept, not retried
                if make is None:
                    self._value = RuntimeError(
                        "tvmbridge: this compile's trace was loaded from the disk cache and keeps no "
                        "decomposed program; trace the module again (tvmbridge.frontend.export.trace) "
                        "or compile with disk_cache=False to inspect it"
                    )
                else:
                    try:
                        self._value = make()
                    except Exception as exc:  # noqa: BLE001 - kept, raised to every reader
                        self._value = exc
            if isinstance(self._value, BaseException):
                raise self._value
            return self._value

    def release(self) -> None:
        """Drop what would make the program (nothing if it was made)."""
        with self._lock:
            self._make = None


def release_program(traced: TracedModule | None) -> None:
    """A finished compile's deferred program let go of the module and sample it would trace."""
    if traced is not None and isinstance(traced.program, Deferred):
        traced.program.release()


@dataclass(frozen=True)
class TracedModule:
    """What tracing learned about a module and one call signature.

    The exported program takes ``user tensors + state tensors`` and returns ``user outputs +
    updated buffers`` (flat)."""

    program: ExportedProgram | Deferred = field(repr=False)  # see ``exported``
    in_spec: pytree.TreeSpec  # of the canonical (args, kwargs)
    out_spec: OutputLayout  # of the module's own output
    constant_leaves: dict[int, Any]  # leaf index -> the non-tensor value the export specialised on
    num_user_inputs: int
    state: ModuleState
    num_user_outputs: int
    updated_buffers: tuple[str, ...]  # state names whose new values follow the user outputs
    updated_inputs: tuple[int, ...] = ()  # user tensors (by position) written in place: new values follow the buffers'
    input_dims: tuple[tuple[int | str, ...], ...] = ()  # per user tensor: ints, symbols where dynamic
    ranges: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)  # symbol -> (lower, upper)
    autocast: AutocastState | None = None  # the autocast the graph was traced under (its casts are ops)
    grad_sources: tuple[frozenset[int], ...] = ()  # per user output, the inputs it has a gradient path from
    no_grad_path: frozenset[int] = frozenset()  # inputs no float user output depends on: no gradient
    constant_outputs: frozenset[int] = frozenset()  # user outputs that are copies of a constant
    cloned_inputs: frozenset[int] = frozenset()  # inputs the forward copies (see program_facts.cloned_inputs)
    copied_outputs: frozenset[int] = frozenset()  # user outputs that are copies (program_facts.copied_outputs)
    returned_inputs: dict[int, int] = field(default_factory=dict)  # user output -> the input it is (returned_inputs)
    graph_digest: str = ""  # frontend.digest of the decomposed program
    coarsest_float: torch.dtype | None = None  # the least precise float dtype of any value computed
    attribute_reads: AttributeReads | None = field(default=None, repr=False)  # per module id, the names read

    @property
    def exported(self) -> ExportedProgram:
        """The program decomposed to core ATen (made now if the trace cache answered the rest)."""
        return self.program.get() if isinstance(self.program, Deferred) else self.program

    def output_of(self, outs: list[torch.Tensor]) -> Any:
        """The module's output from the compiled code's user outputs. An output copied from a
        constant (a cache's ``torch.tensor(window)``) is one buffer of the compiled code on every
        call: each call hands out its own copy, so that a user's in-place edit stays theirs."""
        values = [o.clone() if i in self.constant_outputs else o for i, o in enumerate(outs[: self.num_user_outputs])]
        return unflatten_output(values, self.out_spec)

    @property
    def num_updates(self) -> int:
        """Outputs after the user outputs that carry new values of buffers and inputs."""
        return len(self.updated_buffers) + len(self.updated_inputs)

    @property
    def symbolic(self) -> bool:
        return any(isinstance(d, str) for dims in self.input_dims for d in dims)


def _dynamic_shapes(num_inputs: int, dynamic: dict[int, frozenset[int]]) -> tuple | None:
    """torch.export's ``dynamic_shapes`` for ``FlatCall(*tensors)``: ``Dim.AUTO`` on the marked
    dims of the call's tensors (export then derives the relations between them, and keeps a dim
    static where the program needs it), every other dim static."""
    if not dynamic:
        return None
    auto = torch.export.Dim.AUTO
    return (tuple({d: auto for d in sorted(dynamic[i])} if i in dynamic else None for i in range(num_inputs)),)


_FX_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def _stack_traces(keep: bool) -> Iterator[None]:
    """torch.fx records the Python stack that made each node (``meta["stack_trace"]``), a fifth of
    an export's time; only the float64 localizer reads it (to name the source line of a
    deviating op). The switch is torch's, process-wide: set to ``keep`` for the block and restored
    after, under a lock, so the bridge's own traces never see another's setting (a user's tracing
    in another thread during the block does)."""
    import torch.fx.config as fx_config

    with _FX_CONFIG_LOCK:
        saved = fx_config.do_not_emit_stack_traces
        fx_config.do_not_emit_stack_traces = not keep
        try:
            yield
        finally:
            fx_config.do_not_emit_stack_traces = saved


@contextlib.contextmanager
def _no_attribute_writes(module: torch.nn.Module) -> Iterator[None]:
    """The block (a trace) leaves the module's attributes as they were; assigning any is an
    :class:`AttributeWriteError` naming them (compiled code would not assign them)."""
    before, hooks = module_attributes(module), hook_snapshot(module)
    try:
        yield
    finally:
        changed = changed_attributes(module, before) + restore_hooks(hooks)
        restore_attributes(module, before)
    if changed:
        raise AttributeWriteError(changed, hint=assigning_hooks(module, changed))


def _export(
    module: torch.nn.Module,
    flat: FlatCall,
    inputs: tuple,
    dynamic: dict[int, frozenset[int]] | None = None,
    stack_traces: bool = False,
) -> ExportedProgram:
    with warnings.catch_warnings(), _stack_traces(stack_traces):
        # torch.export deep-copies tree specs and trips torch's own LeafSpec deprecation
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        try:
            # grad on: export marks a no_grad block only where it differs from the mode it traces under
            with (
                untraced_autograd_seen() as untraced,
                host_random_seen() as host_random,
                value_free_hints(),
                noop_casts_kept(),
                torch.enable_grad(),
                _no_attribute_writes(module),
            ):
                ep = _export_or_sample_branches(module, flat, inputs, dynamic)
        except AttributeWriteError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises many types here
            if (refusal := untraced.refusal(type(module).__name__)) is not None:  # what failed, say first
                raise ConversionError("trace", refusal) from exc
            hint = value_read_named(module, exc)
            if hint:
                hint = f"; {hint}"
            elif "Cache" in str(exc):  # transformers' key/value caches
                hint = "; the model builds a key/value cache: train with use_cache=False"
            elif isinstance(exc, UnsampledBranchError):
                hint = f"{data_dependent_hint(exc.first)}; {exc.reason}"
                exc = exc.first
            elif "data-dependent" in str(exc):
                hint = data_dependent_hint(exc)
            raise ConversionError(
                "trace", f"torch.export could not trace {type(module).__name__}: {describe(exc)}{hint}"
            ) from exc
    refusal = untraced.refusal(type(module).__name__) or host_random.refusal(type(module).__name__)
    if refusal is not None:
        raise ConversionError("trace", refusal)
    return ep


def _export_or_sample_branches(
    module: torch.nn.Module, flat: FlatCall, inputs: tuple, dynamic: dict[int, frozenset[int]] | None
) -> ExportedProgram:
    """``torch.export`` of the flat call; where it fails on a branch on a tensor's values that
    PyTorch's own code does not explain, the trace again with that branch as the sample took it,
    guarded at run time (``value_branches``), if that program is safe to compile."""
    shapes = _dynamic_shapes(len(inputs), dynamic or {})
    with quiet_value_reads():
        try:
            return torch.export.export(flat, args=inputs, strict=False, dynamic_shapes=shapes)
        except Exception as exc:  # noqa: BLE001 - torch raises many types here
            if "data-dependent" not in str(exc) or value_read_named(module, exc):
                raise
            first = exc
        try:
            with branches_as_sampled(list({t.device for t in inputs})) as decisions:
                ep = torch.export.export(flat, args=inputs, strict=False, dynamic_shapes=shapes)
        except Exception as second:  # noqa: BLE001 - the first failure is the one to explain, then this
            reason = f"traced as the sample took it, the trace stopped at {describe(second)}"
            raise UnsampledBranchError(first, reason) from second
    refusal = unguarded_decision(decisions) or sampled_branches_refusal(ep)
    if refusal is not None:
        raise UnsampledBranchError(first, f"{refusal} cannot be compiled as the sample took it")
    return ep


def _detach_no_grad_regions(ep: ExportedProgram) -> None:
    """What a ``with torch.no_grad():`` block inside the forward computes is detached: export
    records the block as a ``wrap_with_set_grad_enabled(False, ...)`` call whose body the
    decomposition inlines, and with it the only mark that its results carry no gradient."""
    for module in ep.graph_module.modules():  # a block inside an autocast region sits in its body
        if not isinstance(module, torch.fx.GraphModule):
            continue
        graph = module.graph
        blocks = [
            node
            for node in graph.nodes
            if node.op == "call_function"
            and getattr(node.target, "__name__", "") == "wrap_with_set_grad_enabled"
            and node.args[0] is False
        ]
        if not blocks:  # nothing to change: no recompile (the graph's code generated again)
            continue
        for node in blocks:
            for user in list(node.users):
                if not isinstance(user.meta.get("val"), torch.Tensor):
                    continue
                with graph.inserting_after(user):
                    detached = graph.call_function(torch.ops.aten.detach.default, (user,))
                detached.meta["val"] = user.meta["val"]
                user.replace_all_uses_with(detached, delete_user_cb=lambda n, d=detached: n is not d)
        module.recompile()


def _random_ops_kept() -> contextlib.AbstractContextManager[Any]:
    """The decomposition's dead-code elimination keeping random ops whose values nothing reads.
    Inside a tracing context FX treats random ops as pure unless inductor's ``fallback_random``
    is set, and drops a dropout whose result the call discards (a head the loss does not use,
    CANINE's final character encoder under a classifier); eager still draws its mask, so every
    later draw of the call and the generator's state after it would differ from PyTorch's. Set for
    the decomposition only (a config patch, restored after)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(fallback_random=True)


def _decompose(module: torch.nn.Module, ep: ExportedProgram, stack_traces: bool = False) -> ExportedProgram:
    """``ep`` decomposed to core ATen. Its example inputs are set aside meanwhile: with them,
    torch's decomposition first unlifts the program with a guard function over every input's
    sizes, matching each guard's text against every input's path (quadratic in the inputs: a
    second of a CNN's trace), for a retrace on fake tensors of exactly those sizes, where no
    guard can fail."""
    _detach_no_grad_regions(ep)
    keep_traced_layouts(ep)
    examples = ep.example_inputs
    ep.example_inputs = None
    with warnings.catch_warnings(), _stack_traces(stack_traces), _random_ops_kept():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        try:
            decomposed = ep.run_decompositions(decomposition_table())
        except Exception as exc:  # noqa: BLE001
            raise ConversionError(
                "trace", f"decomposing {type(module).__name__} to core ATen failed: {describe(exc)}"
            ) from exc
        finally:
            ep.example_inputs = examples
    decomposed.example_inputs = examples
    return decomposed


@dataclass(frozen=True)
class RawTrace:
    """A call's first export, before decomposition (what the trace cache keys on), and what
    finishing the trace needs."""

    module: torch.nn.Module
    leaves: list[Any]
    in_spec: pytree.TreeSpec
    tensors: tuple[torch.Tensor, ...]
    inputs: tuple[torch.Tensor, ...]  # the call's tensors, then the state's
    state: ModuleState
    flat: FlatCall
    autocast: AutocastState | None
    dynamic: dict[int, frozenset[int]] | None
    exported: ExportedProgram
    stack_traces: bool = False  # each node's source stack recorded (the localizer's)

    def traced(self, program: ExportedProgram | Deferred, **facts: Any) -> TracedModule:
        """The trace of this call, with what was learned from the decomposed program."""
        assert self.flat.seen.out_spec is not None  # the export ran its forward
        return TracedModule(
            program=program,
            in_spec=self.in_spec,
            out_spec=self.flat.seen.out_spec,
            constant_leaves={i: x for i, x in enumerate(self.leaves) if not isinstance(x, torch.Tensor)},
            num_user_inputs=len(self.tensors),
            state=self.state,
            autocast=self.autocast,
            attribute_reads=self.flat.seen.reads.frozen(),
            **facts,
        )


def export_call(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    dynamic: dict[int, frozenset[int]] | None = None,
    stack_traces: bool = False,
) -> RawTrace:
    """The first half of :func:`trace`: ``torch.export`` of the call in canonical form
    (``stack_traces``: with each node's source stack, see :func:`_stack_traces`)."""
    call_args, call_kwargs = canonical_call(module.forward, args, kwargs)
    if (opaque := opaque_argument_reason(call_args, call_kwargs)) is not None:
        raise ConversionError("inputs", opaque)
    if (hooked := hooks_refusal(module)) is not None:
        raise ConversionError("trace", hooked)
    leaves, in_spec = pytree.tree_flatten((call_args, call_kwargs))
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
    owned = (t for ts in (module.parameters(), module.buffers()) for t in ts)
    device = next((t.device for t in (*tensors, *owned)), None)
    state = ModuleState.of(module, device)
    autocast = AutocastState.current(device.type if device is not None else "cpu")
    for hold in (True, False):
        inputs = tensors + tuple(t.detach() for t in state.tensors(module))
        flat = FlatCall(module, in_spec, leaves, state)
        try:
            ep = _export(module, flat, inputs, dynamic, stack_traces)
            break
        except AttributeWriteError:
            raise
        except ConversionError:
            if not hold or not state.held:
                raise
            # a held tensor read as a value (a Python `if` on it, `.item()`): compiled in as a
            # constant, guarded by identity and version, as before held tensors were inputs
            state = ModuleState.of(module, device, hold=False)
    return RawTrace(module, leaves, in_spec, tensors, inputs, state, flat, autocast, dynamic, ep, stack_traces)


def decompose_call(raw: RawTrace) -> TracedModule:
    """The second half of :func:`trace`: the export decomposed to core ATen, and what it shows."""
    module, tensors, state = raw.module, raw.tensors, raw.state
    ep = _decompose(module, raw.exported, raw.stack_traces)
    updated, updated_inputs = updated_tensors(ep, tensors, state)
    reassigned = reassigned_buffers(raw.flat.seen.reassigned, state)
    updated = tuple(dict.fromkeys(updated + reassigned))
    written = [len(tensors) + state.names.index(n) for n in updated] + list(updated_inputs)
    if written:  # their new values become ordinary outputs
        rewritten = None if reassigned else mutations_as_outputs(ep, written)
        if rewritten is None:  # again, updating clones
            flat = FlatCall(module, raw.in_spec, raw.leaves, state, updated, updated_inputs)
            rewritten = _decompose(
                module, _export(module, flat, raw.inputs, raw.dynamic, raw.stack_traces), raw.stack_traces
            )
            raw.flat.seen.reads.merge(flat.seen.reads)
        ep = rewritten
    if make_dtype_mixing_explicit(ep.graph):  # autocast's mixed-type kernels: one dtype per op
        ep.graph_module.recompile()
    num_user_outputs = check_outputs(ep) - len(updated) - len(updated_inputs)
    user_inputs = user_input_specs(ep)
    others = [s for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
    if len(user_inputs) != len(raw.inputs) or any(s.kind != InputKind.CONSTANT_TENSOR for s in others):
        raise ConversionError(
            "trace",
            f"expected {len(raw.inputs)} tensor inputs in the export (the call's {len(tensors)} and the "
            f"module's {len(state.names)} parameters and buffers) and lifted constants, found "
            f"{[s.kind.name for s in ep.graph_signature.input_specs]}",
        )
    return raw.traced(
        ep,
        num_user_outputs=num_user_outputs,
        updated_buffers=updated,
        updated_inputs=updated_inputs,
        input_dims=input_dims(ep, len(tensors)),
        ranges=ranges(ep),
        grad_sources=grad_sources(ep, num_user_outputs),
        no_grad_path=inputs_without_grad_path(ep, num_user_outputs),
        constant_outputs=constant_outputs(ep, num_user_outputs),
        cloned_inputs=cloned_inputs(ep),
        copied_outputs=copied_outputs(ep, num_user_outputs),
        returned_inputs=returned_inputs(ep, num_user_outputs, written),
        graph_digest=program_digest(ep),
        coarsest_float=coarsest_float(ep),
    )


def trace(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    dynamic: dict[int, frozenset[int]] | None = None,
    stack_traces: bool = False,
) -> TracedModule:
    """Export ``module`` for one call and decompose to core ATen (the form that is converted).
    ``dynamic`` marks dims of the call's tensors (by position among them) to trace symbolically;
    ``stack_traces`` keeps each node's source stack."""
    return decompose_call(export_call(module, args, kwargs, dynamic, stack_traces))
