"""The compiled variants of one dispatched module, each with the guards that say which calls it fits.

A training loop calls a module in more than one way: other batch sizes and sequence lengths,
train and eval mode, a parent passing extra keywords. Each such signature gets its own compiled
variant (as torch.compile keeps one graph per guard set); a call runs the first variant whose
guards all pass. The dispatcher compiles a new variant for a call no variant fits, up to
``cache_size_limit`` of them, and remembers signatures that failed to compile so a failure is
not retried on every call.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from analysis.tensors import tensor_leaves

from ..errors import ConversionError
from ..frontend.call_state import AutocastState
from ..frontend.signature import canonical_call
from .compiled import CompiledModule
from .guards import InputGuard, Mismatch, SymbolicDims, autocast_mismatch, default_dtype_mismatch, tensor_key
from .state_guard import StateGuard
from .verify import Trust


def leaf_labels(cargs: tuple, ckwargs: dict) -> list[str]:
    """``arg 0``, ``hidden_states``, ``past[1]``...: a name for every leaf of a canonical call."""
    paths = pytree.tree_flatten_with_path((cargs, ckwargs))[0]
    labels = []
    for path, _ in paths:
        first = path[1]  # path[0] picks the call's args or kwargs, path[1] the argument there
        if isinstance(first, pytree.SequenceKey):
            name = f"arg {first.idx}"
        else:
            assert isinstance(first, pytree.MappingKey)
            name = str(first.key)
        labels.append(name + pytree.keystr(path[2:]))
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
    if any(
        p.default is inspect.Parameter.empty or isinstance(p.default, torch.Tensor)
        for p in params[n:]
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ):
        return None
    return n


def input_guard_for(
    signature: inspect.Signature, args: tuple, kwargs: dict, dims: SymbolicDims | None = None
) -> InputGuard:
    """The guard of calls like ``(args, kwargs)``: their structure, tensor metadata and values
    (``dims``: a symbolic compile's dims; without, the exact shapes)."""
    cargs, ckwargs = canonical_call(signature, args, kwargs)
    leaves, spec = pytree.tree_flatten((cargs, ckwargs))
    return InputGuard(
        leaves,
        spec,
        leaf_labels(cargs, ckwargs),
        (cargs, ckwargs),
        _positional_form(signature, args, kwargs, leaves),
        dims,
    )


def describe_call(signature: inspect.Signature, args: tuple, kwargs: dict, module: torch.nn.Module) -> str:
    """``train: hidden_states (2, 14, 64) float32, scale=3.0``: the mode and the call's leaves."""
    cargs, ckwargs = canonical_call(signature, args, kwargs)
    parts = []
    params = 0  # parameters passed as arguments (a torch.compile graph's): counted, not listed
    for label, x in zip(leaf_labels(cargs, ckwargs), pytree.tree_leaves((cargs, ckwargs))):
        if isinstance(x, torch.nn.Parameter):
            params += 1
        elif isinstance(x, torch.Tensor):
            parts.append(f"{label} {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}")
        else:
            parts.append(f"{label}={x!r}")
    if params:
        parts.append(f"{params} parameters")
    return f"{'train' if module.training else 'eval'}: {', '.join(parts) or 'no inputs'}"


def call_key(signature: inspect.Signature, args: tuple, kwargs: dict, module: torch.nn.Module) -> tuple:
    """A hashable summary of what a compile depends on most (the call's structure, tensor
    metadata and constants, the state's metadata, every submodule's mode): a signature that
    failed to compile is remembered under it."""
    cargs, ckwargs = canonical_call(signature, args, kwargs)
    leaves, spec = pytree.tree_flatten((cargs, ckwargs))
    call = tuple(tensor_key(x) if isinstance(x, torch.Tensor) else ("value", repr(x)) for x in leaves)
    state = tuple((n, tensor_key(t), t.requires_grad) for n, t in module.state_dict(keep_vars=True).items())
    modes = tuple(m.training for m in module.modules())
    return (str(spec), call, state, modes, AutocastState.current(call_device_type(args, kwargs, module)))


def empty_input(signature: inspect.Signature, args: tuple, kwargs: dict) -> Mismatch | None:
    """A call with a zero-size tensor: TVM's reductions over an empty axis do not give PyTorch's
    zeros, so such calls always run PyTorch."""
    cargs, ckwargs = canonical_call(signature, args, kwargs)
    for label, x in zip(leaf_labels(cargs, ckwargs), pytree.tree_leaves((cargs, ckwargs))):
        if isinstance(x, torch.Tensor) and x.numel() == 0:
            dim = list(x.shape).index(0)
            return Mismatch(
                "empty input", f"{label} dim {dim} is 0 (an empty tensor); empty calls run PyTorch", recompile=False
            )
    return None


@dataclass(frozen=True)
class Fitted:
    """A call that fits a variant: the tensors to pass (the call's, then the state's) and the
    sizes of its symbolic dimensions (empty for a static variant)."""

    tensors: list[torch.Tensor]
    sizes: dict[str, int]


@dataclass(frozen=True)
class Fit:
    """Whether a call fits a variant: its tensors and sizes if so (``fitted``), else the first
    guard's reason; ``inputs_fit``: the call's own arguments fit (only the module's state or the
    autocast differ), which makes the variant the closest one to name in a recompile's reason."""

    fitted: Fitted | None
    reason: Mismatch | None
    inputs_fit: bool

    @property
    def ok(self) -> bool:
        return self.fitted is not None


@dataclass
class Variant:
    """One compiled signature and its guards; ``why`` says what made the dispatcher compile it."""

    compiled: CompiledModule
    input_guard: InputGuard
    state_guard: StateGuard
    label: str
    why: str
    calls: int = 0
    recent_sizes: set = field(default_factory=set)  # of a symbolic variant, since the pool was trimmed
    trust: Trust = field(default_factory=Trust)  # how far its calls were checked against PyTorch
    default_dtype: torch.dtype = field(default_factory=torch.get_default_dtype)  # as traced: made after it

    def tensor_names(self) -> list[str]:
        """A name per tensor the compiled code takes: the call's (as explain() labels them), then the state's."""
        guard = self.input_guard
        return [label for label, k in zip(guard.labels, guard.keys) if k is not None] + list(
            self.compiled.traced.state.names
        )

    def new_sizes_fill_pool(self, sizes: dict[str, int], keep: int = 4) -> bool:
        """Whether a call at ``sizes`` should first trim TVM's memory pool: it is the ``keep + 1``-th
        distinct size since the last trim (the pool keeps buffers by exact size; a loop over
        many lengths would otherwise keep a set of buffers per length)."""
        key = tuple(sorted(sizes.items()))
        if key in self.recent_sizes:
            return False
        self.recent_sizes.add(key)
        if len(self.recent_sizes) <= keep:
            return False
        self.recent_sizes = {key}
        return True

    @classmethod
    def create(
        cls,
        module: torch.nn.Module,
        signature: inspect.Signature,
        compiled: CompiledModule,
        call: tuple[tuple, dict],
        why: str,
    ) -> Variant:
        args, kwargs = call
        traced = compiled.traced
        input_guard = input_guard_for(signature, args, kwargs, SymbolicDims(traced.input_dims, traced.ranges))
        n_user = compiled.traced.num_user_inputs
        # a parameter may require grad if the backward computes its gradient, or none is due (no output depends on it)
        computed = frozenset(i - n_user for i in compiled.grad_param_indices if i >= n_user)
        with_grad = set(computed) | {i - n_user for i in traced.no_grad_path if i >= n_user}
        state_guard = StateGuard(module, traced.state, with_grad, computed, traced.attribute_reads)
        label = describe_call(signature, args, kwargs, module)
        if traced.autocast is not None:
            label = f"{traced.autocast} {label}"
        return cls(compiled, input_guard, state_guard, label, why)

    @property
    def symbolic(self) -> bool:
        return self.compiled.traced.symbolic

    def autocast_mismatch(self) -> Mismatch | None:
        return autocast_mismatch(self.compiled.traced.autocast, self.compiled.device.type)

    def fit(self, module: torch.nn.Module, signature: inspect.Signature, args: tuple, kwargs: dict) -> Fit:
        """The call's tensors (then the state's) and sizes if every guard passes, else the first
        reason; and whether the call's own arguments fit (only the module's state differs)."""
        reason = self.autocast_mismatch() or default_dtype_mismatch(self.default_dtype)
        if reason is not None:
            return Fit(None, reason, inputs_fit=True)
        sizes: dict[str, int] = {}
        user: list[torch.Tensor] | None
        if self.input_guard.fast(args, kwargs):
            user, reason = list(args), None
        else:
            user, reason = self._bind(signature, args, kwargs, sizes)
        if reason is not None:
            return Fit(None, reason, inputs_fit=False)
        assert user is not None  # _bind gives the tensors or a reason
        if any(user[i].requires_grad for i in self.compiled.traced.updated_inputs):
            return Fit(
                None,
                Mismatch(
                    "written input requires grad",
                    "an input the module writes in place requires grad (PyTorch's autograd must see that write)",
                    recompile=False,
                ),
                False,
            )
        reason = self.state_guard.check(module)
        if reason is not None:
            return Fit(None, reason, inputs_fit=True)
        state, reason = self.state_guard.tensors(module)
        if reason is not None:
            return Fit(None, reason, True)
        assert state is not None  # the tensors or a reason
        return Fit(Fitted(user + state, sizes), None, True)

    def _bind(
        self, signature: inspect.Signature, args: tuple, kwargs: dict, sizes: dict[str, int]
    ) -> tuple[list[torch.Tensor] | None, Mismatch | None]:
        try:
            cargs, ckwargs = canonical_call(signature, args, kwargs)
        except ConversionError as exc:
            return None, Mismatch("signature", str(exc), recompile=False)
        leaves, spec = pytree.tree_flatten((cargs, ckwargs))
        reason = self.input_guard.check(leaves, spec, (cargs, ckwargs), sizes)
        return ([x for x in leaves if isinstance(x, torch.Tensor)], None) if reason is None else (None, reason)


def call_device_type(args: tuple, kwargs: dict, module: torch.nn.Module) -> str:
    """The device type a call runs on (its first tensor's, else the module's), for the autocast check."""
    for t in tensor_leaves((args, kwargs)):
        return t.device.type
    for t in module.parameters():
        return t.device.type
    return "cpu"


def _call_tensors(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[list[str], list[torch.Tensor], Any]:
    cargs, ckwargs = canonical_call(signature, args, kwargs)
    leaves, spec = pytree.tree_flatten((cargs, ckwargs))
    labels = leaf_labels(cargs, ckwargs)
    pairs = [(label, x) for label, x in zip(labels, leaves) if isinstance(x, torch.Tensor)]
    return [p[0] for p in pairs], [p[1] for p in pairs], spec


def changed_dims(
    variant: Variant, signature: inspect.Signature, args: tuple, kwargs: dict
) -> dict[int, frozenset[int]] | None:
    """The dims in which a call differs from ``variant``'s tensors (by position among the call's
    tensors), the variant's symbolic dims included, when it differs in sizes only."""
    try:
        _, tensors, spec = _call_tensors(signature, args, kwargs)
    except ConversionError:
        return None
    guard = variant.input_guard
    keys = [k for k in guard.keys if k is not None]
    if spec != guard.spec or len(keys) != len(tensors):
        return None
    dims: dict[int, frozenset[int]] = {}
    traced_dims = variant.compiled.traced.input_dims
    for j, (x, (shape, dtype, device)) in enumerate(zip(tensors, keys)):
        if x.dim() != len(shape) or x.dtype != dtype or x.device != device:
            return None
        symbolic = {d for d, v in enumerate(traced_dims[j]) if isinstance(v, str)} if j < len(traced_dims) else set()
        differ = {d for d, (a, b) in enumerate(zip(x.shape, shape)) if a != b} | symbolic
        differ = {d for d in differ if x.shape[d] > 1}  # export specializes sizes 0 and 1 anyway
        if differ:
            dims[j] = frozenset(differ)
    return dims or None


def marked_dims(
    signature: inspect.Signature, args: tuple, kwargs: dict, marks: dict[str, Any]
) -> dict[int, frozenset[int]] | None:
    """``dynamic={"hidden_states": {1: "seq"}}`` as dims by position among the call's tensors
    (an argument is named as ``explain()`` labels it: its parameter name, or ``arg 0``)."""
    labels, _, _ = _call_tensors(signature, args, kwargs)
    unknown = sorted(set(marks) - set(labels))
    if unknown:
        raise ConversionError(
            "inputs",
            f"dynamic names {unknown}, which are not tensor arguments of this call; the call's tensors are {labels}",
        )
    _, tensors, _ = _call_tensors(signature, args, kwargs)
    out = {}
    for name, dims in marks.items():
        j = labels.index(name)
        out[j] = frozenset(int(d) % tensors[j].dim() for d in dims if tensors[j].shape[int(d)] > 1)
    return {k: v for k, v in out.items() if v} or None


def describe_dims(traced: Any) -> str:
    """``hidden_states (s0, s1, 64)``-style text of a symbolic variant's input dims."""
    return ", ".join(
        f"({', '.join(str(d) for d in dims)})" for dims in traced.input_dims if any(isinstance(d, str) for d in dims)
    )
