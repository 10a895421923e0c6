"""What a compiled variant depends on, checked cheaply at every call, with the reason it does not fit.

In the spirit of torch.compile's guards: the compiled code is specialised on the call (tensor
shapes, dtypes, devices, which inputs require grad, the non-tensor arguments: here) and on the
module (:mod:`.state_guard`). Any difference is a :class:`Mismatch` naming what changed; the
dispatcher then runs PyTorch instead of stale compiled code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ..frontend.call_state import AutocastState
from ..sizes import evaluate_dims

if TYPE_CHECKING:
    from ..frontend.export import TracedModule


@dataclass(frozen=True)
class Mismatch:
    """Why a call does not fit: ``key`` groups calls that differ the same way (one warning per
    key), ``message`` says what differs, ``recompile`` whether a variant compiled for the call
    would fit it (not so for hooks on submodules, autocast, an active dispatch mode, ...)."""

    key: str
    message: str
    recompile: bool = True
    structural: bool = False  # the call is written differently (keywords, positional count)
    emptied: bool = False  # a cache the variant reads was emptied (the forward may fill it again)


def flags_hold(flags: Sequence[torch.Tensor]) -> bool:
    """Whether the compiled code's value flags all hold (1: every index of that read was in range,
    every condition the forward asserts on a tensor's value true)."""
    return all(int(flag) == 1 for flag in flags)


def call_flags_hold(traced: TracedModule, outs: Sequence[torch.Tensor]) -> bool:
    """Whether a compiled call's flags (its outputs after the user's and the updated buffers') hold."""
    return flags_hold(outs[traced.num_user_outputs + traced.num_updates :])


# a call whose flags fail: the compiled reads were clipped, or an assertion was broken
VALUE_CHECK_FAILED = Mismatch(
    "value check",
    "a check the compiled code makes on the call's values failed (an index out of range, or a condition "
    "the forward asserts on a tensor's value, such as `assert lengths.max().item() <= seq_len`): PyTorch "
    "ran the call, so it raises as PyTorch raises",
    recompile=False,
)


def check_index_flags(flags: Sequence[torch.Tensor]) -> None:
    """Raise where a flag failed (:func:`flags_hold`), as PyTorch raises for an index out of range
    (code that has no PyTorch to run the call: ``compile_inference``)."""
    if not flags_hold(flags):
        raise IndexError("index out of range in self (or a condition the forward asserts on a tensor's value failed)")


def autocast_mismatch(compiled_under: AutocastState | None, device_type: str) -> Mismatch | None:
    """Why the autocast in effect now is not the one a compile was traced under (its casts are
    compiled in), or None."""
    if compiled_under is None and not torch.is_autocast_enabled(device_type):
        return None
    now = AutocastState.current(device_type)
    if now == compiled_under:
        return None
    return Mismatch(
        "autocast",
        f"the call runs {now or 'without autocast'}, it was compiled "
        f"{'under ' + str(compiled_under) if compiled_under else 'without autocast'}",
    )


def default_dtype_mismatch(compiled_under: torch.dtype) -> Mismatch | None:
    """Why torch's default dtype now is not the one a compile was traced under (a tensor the
    forward creates without a dtype, ``torch.tensor(0.5)``, ``torch.zeros(n)``, is compiled in
    with it), or None; as torch.compile's global-state guard."""
    now = torch.get_default_dtype()
    if now is compiled_under:
        return None
    return Mismatch(
        "default dtype",
        f"torch's default dtype is {now}, it was compiled under {compiled_under} (tensors the forward "
        "creates without a dtype take it)",
    )


def tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device)


def describe_tensor_difference(what: str, got: torch.Tensor, want: tuple) -> Mismatch:
    shape, dtype, device = want
    if tuple(got.shape) != shape:
        if len(got.shape) != len(shape):
            return Mismatch(f"{what} rank", f"{what} has {got.dim()} dims, compiled for {len(shape)}")
        dim = next(i for i, (a, b) in enumerate(zip(got.shape, shape)) if a != b)
        return Mismatch(f"{what} dim {dim}", f"{what} dim {dim} is {got.shape[dim]}, compiled for {shape[dim]}")
    if got.dtype != dtype:
        return Mismatch(f"{what} dtype", f"{what} is {got.dtype}, compiled for {dtype}")
    return Mismatch(f"{what} device", f"{what} is on {got.device}, compiled for {device}")


def short_value(value: Any) -> str:
    """A value as a message shows it: a tensor by its shape and dtype, anything else by a short repr."""
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class InputGuard:
    """The call's structure, tensor metadata and non-tensor values, as compiled."""

    def __init__(
        self,
        leaves: list[Any],
        spec: pytree.TreeSpec,
        labels: list[str],
        call: tuple[tuple, dict],
        positional: int | None,
        dims: SymbolicDims | None = None,
    ) -> None:
        self.spec = spec
        self.labels = labels
        self.num_args, self.kwargs = len(call[0]), dict(call[1])
        self.positional = positional  # a call of this many tensors, no keywords, is the compiled form
        self.keys = [tensor_key(x) if isinstance(x, torch.Tensor) else None for x in leaves]
        self.constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
        self.dims = dims if dims is not None and dims.symbolic else None
        if self.dims is not None:
            self.dims.attach([i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)])

    def fast(self, args: tuple, kwargs: dict) -> bool:
        """A plain positional call of tensors that fits (no signature binding needed)."""
        if kwargs or self.positional is None or len(args) != self.positional or self.dims is not None:
            return False
        for x, key in zip(args, self.keys):
            if key is None or not isinstance(x, torch.Tensor):
                return False
            shape, dtype, device = key
            if x.shape != shape or x.dtype != dtype or x.device != device:
                return False
        return True

    def structure(self, call: tuple[tuple, dict]) -> Mismatch:
        """What differs in a call whose structure is not the compiled one."""
        args, kwargs = call
        if len(args) != self.num_args:
            return Mismatch(
                "positional count", f"{len(args)} positional arguments, compiled for {self.num_args}", structural=True
            )
        for name, value in self.kwargs.items():
            if name not in kwargs:
                return Mismatch(
                    f"{name} omitted", f"{name} is left at its default, compiled for {name}={value!r}", structural=True
                )
        for name in kwargs:
            if name not in self.kwargs:
                return Mismatch(
                    f"{name} given",
                    f"{name}={short_value(kwargs[name])} is given, compiled with it left at its default",
                    structural=True,
                )
        return Mismatch(
            "call structure", "the nesting of tuples/lists/dicts in the arguments differs from the compiled call"
        )

    def check(
        self, leaves: list[Any], spec: pytree.TreeSpec, call: tuple[tuple, dict], sizes: dict[str, int] | None = None
    ) -> Mismatch | None:
        """Why the call does not fit, or None; a symbolic variant's sizes go into ``sizes``."""
        if spec != self.spec:
            return self.structure(call)
        sizes = sizes if sizes is not None else {}
        derived: list = []  # symbolic dims given by an expression, checked once all are bound
        for i, x in enumerate(leaves):
            want = self.keys[i]
            if want is None:
                c = self.constants[i]
                if isinstance(x, torch.Tensor) or not (x is c or (type(x) is type(c) and x == c)):
                    return Mismatch(f"{self.labels[i]} value", f"{self.labels[i]} is {x!r}, compiled for {c!r}")
            elif not isinstance(x, torch.Tensor):
                return Mismatch(
                    f"{self.labels[i]} type", f"{self.labels[i]} is a {type(x).__name__}, compiled for a tensor"
                )
            elif self.dims is not None:
                reason = self.dims.check_tensor(i, self.labels[i], x, want, sizes, derived)
                if reason is not None:
                    return reason
            elif tensor_key(x) != want:
                return describe_tensor_difference(self.labels[i], x, want)
        return self.dims.check_derived(derived, sizes) if self.dims is not None else None


class SymbolicDims:
    """The dims of a symbolic variant's tensors: ints, or torch's symbol expressions (``s0``,
    ``2*s0``) with the ranges export derived; a call fits when its sizes bind every symbol
    consistently, within range."""

    def __init__(
        self, dims: tuple[tuple[int | str, ...], ...], ranges: dict[str, tuple[int | None, int | None]]
    ) -> None:
        self.per_tensor = dims
        self.ranges = ranges
        self.leaf_dims: dict[int, tuple[int | str, ...]] = {}

    @property
    def symbolic(self) -> bool:
        return any(isinstance(d, str) for dims in self.per_tensor for d in dims)

    def attach(self, tensor_leaves: list[int]) -> None:
        self.leaf_dims = dict(zip(tensor_leaves, self.per_tensor))

    def check_tensor(
        self, leaf: int, label: str, x: torch.Tensor, key: tuple, sizes: dict[str, int], derived: list
    ) -> Mismatch | None:
        """Whether tensor leaf ``leaf`` fits, binding its symbols into ``sizes``."""
        _, dtype, device = key
        dims = self.leaf_dims[leaf]
        if x.dim() != len(dims) or x.dtype != dtype or x.device != device:
            return describe_tensor_difference(label, x, (tuple(1 for _ in dims), dtype, device))
        for d, (want, got) in enumerate(zip(dims, x.shape)):
            reason = self._bind(f"{label} dim {d}", want, int(got), sizes, derived)
            if reason is not None:
                return reason
        return None

    def _bind(self, what: str, want: int | str, got: int, sizes: dict[str, int], derived: list) -> Mismatch | None:
        if isinstance(want, int):
            return None if want == got else Mismatch(what, f"{what} is {got}, compiled for {want}")
        if not want.isidentifier():
            derived.append((what, want, got))
            return None
        if sizes.setdefault(want, got) != got:
            return Mismatch(what, f"{what} is {got}, but the compiled code needs it equal to {want} = {sizes[want]}")
        lower, upper = self.ranges.get(want, (0, None))
        if (lower is not None and got < lower) or (upper is not None and got > upper):
            return Mismatch(what, f"{what} is {got}, outside the compiled range [{lower}, {upper}] of {want}")
        return None

    @staticmethod
    def check_derived(derived: list, sizes: dict[str, int]) -> Mismatch | None:
        """The dims given by an expression of symbols (``2*s0``), once every symbol is bound."""
        for what, expr, got in derived:
            try:
                want = evaluate_dims((expr,), sizes)[0]
            except (TypeError, ValueError):
                return Mismatch(what, f"{what}: its size {expr} is not determined by the call")
            if want != got:
                return Mismatch(what, f"{what} is {got}, but the compiled code needs {expr} = {want}")
        return None
