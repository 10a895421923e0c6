"""What a decomposed export shows: its inputs and outputs as the call passes them, the buffers
and inputs it writes in place, symbol ranges, outputs that are constants, inputs without a
gradient path. Read once per trace and kept in :class:`~.export.TracedModule`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..errors import ConversionError
from .call_state import ModuleState

# ops that return their input's value (what a traced ``.clone()``, ``.to()`` or ``.detach()`` leaves)
COPY_OPS = ("clone.default", "_to_copy.default", "alias.default", "lift_fresh_copy.default", "detach.default")


def constant_outputs(ep: ExportedProgram, num_user_outputs: int) -> frozenset[int]:
    """User outputs whose value is a lifted constant, directly or through copies."""
    constants = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR}
    found = set()
    for i, node in enumerate(list(ep.graph.find_nodes(op="output"))[0].args[0][:num_user_outputs]):
        while isinstance(node, torch.fx.Node) and getattr(node.target, "__name__", "") in COPY_OPS:
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.name in constants:
            found.add(i)
    return frozenset(found)


# ops that read only their input's shape, dtype and device (ATen's derivatives list them as not
# differentiable): ``zeros_like(x) + y`` leaves ``x.grad`` None
_METADATA_ONLY = frozenset(
    f"{op}.default"
    for op in ("full_like", "zeros_like", "ones_like", "empty_like", "rand_like", "randn_like", "randint_like")
) | frozenset({"new_zeros.default", "new_ones.default", "new_empty.default", "new_full.default"})


def creates_no_graph(node: torch.fx.Node) -> bool:
    """Ops whose result PyTorch's autograd does not connect to their inputs: ``detach`` and the
    ``*_like``/``new_*`` constructors."""
    name = getattr(node.target, "__name__", "")
    return name == "detach.default" or name in _METADATA_ONLY


def passes_no_gradient(node: torch.fx.Node) -> bool:
    """Ops whose backward PyTorch leaves undefined for their inputs: those of
    :func:`creates_no_graph`, and ``linalg_vector_norm`` with ``ord=0`` (a count of nonzeros:
    its result has a gradient function, its input gets none), so an input reached only through
    them keeps ``.grad`` None."""
    if creates_no_graph(node):
        return True
    if getattr(node.target, "__name__", "") == "linalg_vector_norm.default":
        ord_ = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
        return isinstance(ord_, (int, float)) and ord_ == 0
    return False


def _is_float(node: torch.fx.Node) -> bool:  # a multi-output op (native_dropout) carries a tuple
    val = node.meta.get("val")
    return any(
        isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex)
        for v in (val if isinstance(val, (tuple, list)) else (val,))
    )


def _sources(ep: ExportedProgram, stop: Callable[[torch.fx.Node], bool]) -> list[frozenset[int]]:
    """Per user output, the export's inputs (by position) it depends on through floating-point
    values, a node where ``stop`` holds depending on none: one pass in graph order, each node's
    inputs a bit mask."""
    position = {spec.arg.name: i for i, spec in enumerate(user_input_specs(ep))}
    masks: dict[torch.fx.Node, int] = {}
    for node in ep.graph.nodes:
        mask = 0
        if node.op == "placeholder":
            mask = 1 << position[node.name] if node.name in position else 0
        elif not stop(node):
            for n in node.all_input_nodes:
                mask |= masks.get(n, 0) if _is_float(n) else 0
        masks[node] = mask
    outputs = list(ep.graph.find_nodes(op="output"))[0].args[0]
    found = []
    for out in outputs:
        mask = masks[out] if isinstance(out, torch.fx.Node) and _is_float(out) else 0
        found.append(frozenset(i for i in range(mask.bit_length()) if mask >> i & 1))
    return found


def grad_sources(ep: ExportedProgram, num_user_outputs: int) -> tuple[frozenset[int], ...]:
    """Per user output, the inputs autograd connects it to: an output connected to none that
    requires grad comes back without ``requires_grad`` (``torch.arange(n) * 2``,
    ``x.detach() * 3``), as PyTorch returns it."""
    return tuple(_sources(ep, creates_no_graph)[:num_user_outputs])


def inputs_without_grad_path(ep: ExportedProgram, num_user_outputs: int) -> frozenset[int]:
    """The export's inputs from which no floating-point user output gets a gradient: PyTorch
    leaves their ``.grad`` None (an unused ``mask_token``, a weight that only feeds a
    comparison), so the compiled backward must not hand back zeros."""
    reached = frozenset().union(*_sources(ep, passes_no_gradient)[:num_user_outputs])
    return frozenset(i for i in range(len(user_input_specs(ep))) if i not in reached)


# ops whose result is a view of their first argument's memory
_VIEWS = frozenset(
    f"{op}.default"
    for op in ("alias", "view", "_unsafe_view", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand")
) | frozenset({"squeeze.dim", "squeeze.dims", "transpose.int", "slice.Tensor", "select.int"})


def _copies(node: torch.fx.Node) -> bool:
    """``clone``, or a ``to`` of the same dtype: a fresh copy of its input's value, which TVM folds."""
    name = getattr(node.target, "__name__", "")
    if name == "clone.default":
        return True
    source = node.args[0] if node.args else None
    if name != "_to_copy.default" or not isinstance(source, torch.fx.Node):
        return False
    a, b = source.meta.get("val"), node.meta.get("val")
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype


def cloned_inputs(ep: ExportedProgram) -> frozenset[int]:
    """The export's inputs (by position) the forward copies, directly or through a ``detach``:
    PyTorch saves such a copy, apart from the input, and an in-place write to the input before
    the backward (the next call's power iteration of ``spectral_norm``) leaves it be. TVM folds
    the copy into the input, so a backward reading it reads the input: the call saves a copy of
    those it reads."""
    position = {spec.arg.name: i for i, spec in enumerate(user_input_specs(ep))}
    found = set()
    for placeholder in ep.graph.find_nodes(op="placeholder"):
        todo = [placeholder] if placeholder.name in position else []
        while todo:
            for user in todo.pop().users:
                if getattr(user.target, "__name__", "") in ("alias.default", "detach.default"):
                    todo.append(user)
                elif _copies(user):
                    found.add(position[placeholder.name])
    return frozenset(found)


def copied_outputs(ep: ExportedProgram, num_user_outputs: int) -> frozenset[int]:
    """User outputs that are copies (``h.clone()``, ``h.t().contiguous().t()``), or views of one:
    PyTorch returns memory apart from the value copied, which the user may edit in place even
    where the backward reads that value. TVM folds the copy into the value; where the value is
    kept for the backward, the call hands out a copy instead of guarding the value."""
    found = set()
    for i, node in enumerate(list(ep.graph.find_nodes(op="output"))[0].args[0][:num_user_outputs]):
        while isinstance(node, torch.fx.Node) and getattr(node.target, "__name__", "") in _VIEWS:
            node = node.args[0]
        if isinstance(node, torch.fx.Node) and _copies(node):
            found.add(i)
    return frozenset(found)


def returned_inputs(ep: ExportedProgram, num_user_outputs: int, written: list[int]) -> dict[int, int]:
    """User output -> input position, for each output that is an input itself: returned as is
    (``return x``, a parameter), or after the call wrote it (``self.last.copy_(h); return
    self.last``; ``written``: the inputs whose new values follow the user outputs, in order).
    PyTorch returns that very tensor, and a later write to it shows in what the user kept; the
    compiled code's output is a fresh tensor, so the call hands out the input instead."""
    outputs = list(ep.graph.find_nodes(op="output"))[0].args[0]
    position = {spec.arg.name: i for i, spec in enumerate(user_input_specs(ep))}
    new_values = {outputs[num_user_outputs + k]: j for k, j in enumerate(written)}
    found = {}
    for i, node in enumerate(outputs[:num_user_outputs]):
        if node in new_values:
            found[i] = new_values[node]
        elif isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.name in position:
            found[i] = position[node.name]
    return found


def coarsest_float(ep: ExportedProgram) -> torch.dtype | None:
    """The least precise floating dtype any operation of the program computes (None: none
    computes floats). A float64 model that computes a norm or a softmax in float32
    (transformers' RMSNorm casts to float32 and back) is only float32-accurate there: the
    safety net judges its outputs with float32's tolerance, as it judges an autocast call with
    the autocast dtype's. Inputs are not operations: a bfloat16 buffer widened exactly on its way
    in leaves a float32 model float32-accurate, and its net as tight."""
    found: set[torch.dtype] = set()
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                found.add(value.dtype)
    return max(found, key=lambda d: torch.finfo(d).eps, default=None)


def ranges(ep: ExportedProgram) -> dict[str, tuple[int | None, int | None]]:
    """Each shape symbol's range as export derived it (``None``: no bound that side; a value
    read from a tensor, ``lengths.max().item()``, has none either side)."""
    import math

    def bound(value: object) -> int | None:
        number = float(value)  # type: ignore[arg-type]  # a sympy number, infinite ones too
        return None if math.isinf(number) else int(number)

    return {str(symbol): (bound(vr.lower), bound(vr.upper)) for symbol, vr in ep.range_constraints.items()}


def input_dims(ep: ExportedProgram, num_user: int) -> tuple[tuple[int | str, ...], ...]:
    """Per user tensor input, its dims as traced: an int, or the symbol's expression as text
    (``s0``; relations show as shared symbols or expressions such as ``2*s0``)."""
    dims = []
    placeholders = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    for spec in user_input_specs(ep)[:num_user]:
        node = placeholders[spec.arg.name]
        dims.append(tuple(int(d) if isinstance(d, int) else str(d.node.expr) for d in node.meta["val"].shape))
    return tuple(dims)


def user_input_specs(ep: ExportedProgram) -> list:
    """The export's inputs that the call passes (its tensors, then the module's state), in order;
    constants the forward creates (``torch.tensor(...)``) are lifted as well and bound by the
    converter."""
    return [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def reassigned_buffers(names: tuple[str, ...], state: ModuleState) -> tuple[str, ...]:
    """The state names the forward assigned anew: buffers only (a parameter replaced in forward
    would leave the optimizer holding the old one)."""
    params = [n for n in names if state.is_parameter[state.names.index(n)]]
    if params:
        raise ConversionError("trace", f"the module assigns its own parameters anew in forward ({', '.join(params)})")
    return names


def updated_tensors(
    ep: ExportedProgram, tensors: tuple[torch.Tensor, ...], state: ModuleState
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """What the call writes in place: buffers (running statistics) by state name, and the call's
    own tensors by position (a graph from torch.compile takes the buffers as inputs). Parameters
    and tensors that require grad may not be written (a forward that writes what it is
    differentiated by cannot be differentiated)."""
    num_user = len(tensors)
    specs = user_input_specs(ep)
    mutated = set(ep.graph_signature.user_inputs_to_mutate.values())
    written = [i for i, s in enumerate(specs) if s.arg.name in mutated]
    names = tuple(state.names[i - num_user] for i in written if i >= num_user)
    inputs = tuple(i for i in written if i < num_user)
    params = [n for n in names if state.is_parameter[state.names.index(n)]]
    if params:
        raise ConversionError(
            "trace",
            f"the module writes its own parameters in forward ({', '.join(params)}): the bridge compiles "
            "forward and backward, not parameter updates (an optimizer's step runs in PyTorch)",
        )
    if any(tensors[i].requires_grad for i in inputs):
        raise ConversionError(
            "trace",
            "the module writes in place into an input that requires grad; only inputs "
            "without a gradient (buffers, counters) can be written",
        )
    return names, inputs


def check_outputs(ep: ExportedProgram) -> int:
    """The number of outputs, all of which must be tensors."""
    out_nodes = list(ep.graph.find_nodes(op="output"))[0].args[0]
    for o in out_nodes:
        if not isinstance(o, torch.fx.Node) or not isinstance(o.meta.get("val"), torch.Tensor):
            raise ConversionError(
                "trace",
                f"output {o!r} is not a tensor; only (nested tuples of) tensors can be returned by a compiled module",
            )
    return len(out_nodes)


def mutations_as_outputs(ep: ExportedProgram, written: list[int]) -> ExportedProgram | None:
    """``ep`` with the new values of the inputs it writes (``written``, by position among the
    user inputs) returned as ordinary outputs after its own, in that order, and no input
    mutations left: what tracing a call that updates clones instead would give, without
    exporting and decomposing it a second time (half a BatchNorm model's trace). ``None`` where
    the program returns anything else (effect tokens, say): the caller traces again."""
    from torch.export.exported_program import ExportGraphSignature
    from torch.export.graph_signature import OutputKind, OutputSpec, TensorArgument

    output = next(iter(ep.graph.find_nodes(op="output")))
    specs = ep.graph_signature.output_specs
    values = list(output.args[0])
    own = [(v, s) for v, s in zip(values, specs) if s.kind == OutputKind.USER_OUTPUT]
    mutated = {s.target: v for v, s in zip(values, specs) if s.kind == OutputKind.USER_INPUT_MUTATION}
    names = [s.arg.name for s in user_input_specs(ep)]
    if len(own) + len(mutated) != len(specs) or set(mutated) != {names[i] for i in written}:
        return None
    new_values = [mutated[names[i]] for i in written]
    if not all(isinstance(v, torch.fx.Node) for v in new_values):
        return None
    output.args = ((*(v for v, _ in own), *new_values),)
    signature = ExportGraphSignature(
        input_specs=list(ep.graph_signature.input_specs),
        output_specs=[s for _, s in own]
        + [OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(name=v.name), target=None) for v in new_values],
    )
    out_spec = pytree.tree_flatten(tuple(range(len(output.args[0]))))[1]
    calls = [
        dataclasses.replace(e, signature=dataclasses.replace(e.signature, out_spec=out_spec))
        if e.fqn == "" and e.signature is not None
        else e
        for e in ep.module_call_graph
    ]
    return ExportedProgram(
        root=ep.graph_module,
        graph=ep.graph,
        graph_signature=signature,
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=calls,
        example_inputs=ep.example_inputs,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )
