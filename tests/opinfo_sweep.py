"""PyTorch's own OpInfo samples through the bridge: each op as a one-op module, against PyTorch.

For every OpInfo in ``op_db`` whose first sample exports to aten ops the converter has a
converter for (``frontend.checks.unsupported_ops`` empty: the ops the bridge *claims*), each
sample runs as a one-op ``nn.Module`` through ``add_tvm_dispatch``: in float64 with a backward
(outputs and the input gradients against autograd), and the first sample in float32 forward too.
Every case ends as

* ``exact``: outputs (and gradients) within the tolerances below;
* ``refused``: a ``ConversionError``/``UnsupportedOpError`` at compile, or a call that ran PyTorch
  with a ``FallbackWarning``; the reason is kept;
* ``skip``: a case that cannot be compared, with the reason (PyTorch itself fails on the sample,
  no tensor output, an op that draws random numbers outside PyTorch's generator order);
* ``wrong`` (a number off) or ``crash`` (any other exception): failures.

Used by ``tests/tvmbridge/test_opinfo.py`` and ``scripts/opinfo_sweep.py``.
"""
from __future__ import annotations

import collections
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

# float64: exact up to rounding; float32 forward: fast_math's few ulps and other summation orders
TOLERANCES = {torch.float64: (1e-9, 1e-10), torch.float32: (2e-5, 2e-5)}  # (rtol, atol)
OUTCOMES = ("exact", "refused", "skip", "wrong", "crash")
# OpInfo calls its random ops through ``wrapper_set_seed`` (``torch.manual_seed(42)`` inside the
# call): a side effect no trace keeps. Seeding 42 before every call gives both sides that state.
SEED = 42
# Outputs that are uninitialized memory: nothing to compare.
UNINITIALIZED = {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}
# Where PyTorch itself is less exact than the bridge, and by how much (rtol, atol in float64).
LOOSER = {
    # ATen's float64 hardsigmoid_backward multiplies by 1/6 rounded to float32 (3e-9 relative)
    "nn.functional.hardsigmoid": (1e-8, 1e-8),
}


@dataclass(frozen=True)
class Outcome:
    op: str  # OpInfo name (with its variant)
    sample: int
    dtype: str
    kind: str  # one of OUTCOMES
    reason: str = ""


def op_db() -> list:
    """The OpInfos (importing them takes seconds and needs ``expecttest``)."""
    from torch.testing._internal.common_methods_invocations import op_db as ops

    return list(ops)


def full_name(info: Any) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


class OneOp(torch.nn.Module):
    """``fn(*args, **kwargs)`` of a sample, its tensors the module's inputs (in pytree order),
    its outputs the tensors of the result."""

    def __init__(self, fn: Callable, spec: pytree.TreeSpec, leaves: list) -> None:
        super().__init__()
        self.fn, self.spec = fn, spec
        self.slots = [None if isinstance(v, torch.Tensor) else (v,) for v in leaves]  # None: an input

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten([next(it) if s is None else s[0] for s in self.slots], self.spec)
        out = self.fn(*args, **kwargs)
        return tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def one_op(info: Any, sample: Any, dtype: torch.dtype) -> tuple[OneOp, tuple[torch.Tensor, ...]]:
    """The sample as a module and its tensor inputs, float tensors cast to ``dtype``."""
    call = ((sample.input, *sample.args), dict(sample.kwargs))
    leaves, spec = pytree.tree_flatten(call)
    tensors = tuple(cast(t, dtype) for t in leaves if isinstance(t, torch.Tensor))
    # a dtype argument of the float64 sample (``input_dtype=torch.float64``) follows the cast
    leaves = [dtype if v is torch.float64 else v for v in leaves]
    return OneOp(info.op, spec, leaves), tensors


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach()
    return t.to(dtype) if t.is_floating_point() else t.clone()


def samples(info: Any, limit: int) -> list:
    """Up to ``limit`` float64 samples (the float32 cases are their casts)."""
    try:
        it = info.sample_inputs("cpu", torch.float64, requires_grad=info.supports_autograd)
        return [s for _, s in zip(range(limit), it)]
    except Exception:  # noqa: BLE001 - an OpInfo without float64 samples has no case here
        return []


def claimed(info: Any) -> bool:
    """The converter claims the op: its first sample exports to aten ops it converts."""
    from tvmbridge.frontend.export import trace
    from tvmbridge.frontend.checks import unsupported_ops

    first = samples(info, 1)
    if not first:
        return False
    module, tensors = one_op(info, first[0], torch.float64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = trace(module, tensors)
    except Exception:  # noqa: BLE001 - what torch.export cannot take, the bridge does not claim
        return False
    return not unsupported_ops(traced.exported)


def reference(module: OneOp, tensors: tuple, grad: bool) -> tuple[list, list | None]:
    """PyTorch's outputs and (``grad``) input gradients for fixed random output gradients."""
    inputs = [t.clone().requires_grad_(grad and t.is_floating_point()) for t in tensors]
    torch.manual_seed(SEED)
    outs = list(module(*inputs))
    if not grad:
        return [o.detach() for o in outs], None
    wrt = [t for t in inputs if t.requires_grad]
    diff = [(o, cotangent(o, i)) for i, o in enumerate(outs) if o.requires_grad]
    if not wrt or not diff:
        return [o.detach() for o in outs], []
    grads = torch.autograd.grad([o for o, _ in diff], wrt, [g for _, g in diff], allow_unused=True)
    return [o.detach() for o in outs], [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]


def cotangent(out: torch.Tensor, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + index)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, op: str = "") -> str | None:
    """None when ``got`` matches; else what differs."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    if not want.is_floating_point():
        return None if torch.equal(got, want) else "integer values differ"
    rtol, atol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    if dtype == torch.float64 and op in LOOSER:
        rtol, atol = LOOSER[op]
    if torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
        return None
    err = (got - want).abs().nan_to_num(math.inf).max().item()
    return f"max abs error {err:.3g}"


def run_case(info: Any, sample: Any, index: int, dtype: torch.dtype) -> Outcome:
    """One sample in one dtype: float64 with input gradients, float32 forward only."""
    from tvmbridge import ConversionError, FallbackWarning, VerificationWarning, add_tvm_dispatch

    name, label = full_name(info), str(dtype).removeprefix("torch.")
    if name in UNINITIALIZED:
        return Outcome(name, index, label, "skip", "the output is uninitialized memory")
    module, tensors = one_op(info, sample, dtype)
    grad = dtype == torch.float64 and info.supports_autograd and any(t.is_floating_point() for t in tensors)
    try:
        want, want_grads = reference(module, tensors, grad)
    except Exception as exc:  # noqa: BLE001
        return Outcome(name, index, label, "skip", f"PyTorch fails on the sample: {first_line(exc)}")
    if not want:
        return Outcome(name, index, label, "skip", "no tensor output")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            add_tvm_dispatch(module, tensors)
            got, got_grads = reference(module, tensors, grad)
        except ConversionError as exc:
            return Outcome(name, index, label, "refused", first_line(exc))
        except Exception as exc:  # noqa: BLE001
            return Outcome(name, index, label, "crash", f"{type(exc).__name__}: {first_line(exc)}")
    caught_wrong = [w for w in caught if issubclass(w.category, VerificationWarning)]
    if caught_wrong:  # the first-call check caught wrong numbers: a bug, though the user got PyTorch's
        return Outcome(name, index, label, "wrong", f"caught by the first-call check: {first_line(caught_wrong[0].message)}")
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    if fallbacks:
        return Outcome(name, index, label, "refused", first_line(fallbacks[0].message))
    for what, a, b in [*(("out", x, y) for x, y in zip(got, want)), *(("grad", x, y) for x, y in zip(got_grads or [], want_grads or []))]:
        diff = close(a, b, dtype, name)
        if diff:
            return Outcome(name, index, label, "wrong", f"{what}: {diff}")
    return Outcome(name, index, label, "exact")


def first_line(exc: object) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def sweep(infos: list, samples_per_op: int, progress: Callable[[Outcome], None] | None = None) -> Iterator[Outcome]:
    """Every case of the claimed ops among ``infos``: each sample in float64 (outputs and
    gradients), the first one in float32 too (outputs: the float32 kernels and fast math)."""
    for info in infos:
        if not claimed(info):
            continue
        for i, sample in enumerate(samples(info, samples_per_op)):
            for dtype in (torch.float64, torch.float32)[:2 if i == 0 else 1]:
                if dtype not in info.supported_dtypes("cpu"):
                    continue
                outcome = run_case(info, sample, i, dtype)
                if progress:
                    progress(outcome)
                yield outcome


def summary(outcomes: list[Outcome]) -> str:
    """``N/M exact, R refused, W wrong, C crash`` (and skips), M the cases not skipped."""
    n = collections.Counter(o.kind for o in outcomes)
    total = sum(n[k] for k in OUTCOMES if k != "skip")
    return (f"{n['exact']}/{total} exact, {n['refused']} refused, {n['wrong']} wrong, {n['crash']} crash"
            f" ({n['skip']} skipped, {len({o.op for o in outcomes})} ops)")


def refusals_by_reason(outcomes: list[Outcome]) -> dict[str, list[str]]:
    """Refusal reasons (stage and op, the variable part of a message cut) -> the ops refused so."""
    groups: dict[str, set[str]] = collections.defaultdict(set)
    for o in outcomes:
        if o.kind == "refused":
            groups[o.reason[:160]].add(o.op)
    return {k: sorted(v) for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))}


def silent_on_error_input(info: Any, error_input: Any) -> str | None:
    """One of PyTorch's ``error_inputs`` (a call ATen refuses) through the bridge: None where the
    dispatched module raises too (at compile, or when called) or PyTorch refuses nothing here;
    else what the compiled code returned instead of raising."""
    from tvmbridge import add_tvm_dispatch

    s = error_input.sample_input
    leaves, spec = pytree.tree_flatten(((s.input, *s.args), dict(s.kwargs)))
    tensors = tuple(t.detach().clone() for t in leaves if isinstance(t, torch.Tensor))
    module = OneOp(info.op, spec, leaves)
    try:
        module(*tensors)
        return None  # PyTorch accepts it here: nothing to compare
    except Exception:  # noqa: BLE001
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            add_tvm_dispatch(module, tensors, verify=False)
            out = module(*tensors)
        except Exception:  # noqa: BLE001 - raised, as PyTorch does
            return None
    return f"{full_name(info)}: returned {[tuple(o.shape) for o in out]} where PyTorch raises {error_input.error_regex[:80]!r}"


def error_sweep(infos: list, per_op: int = 12) -> Iterator[str]:
    """What the claimed ops among ``infos`` return silently on PyTorch's error inputs."""
    for info in infos:
        if getattr(info, "error_inputs_func", None) is None:
            continue
        try:
            errors = list(info.error_inputs(torch.device("cpu")))
        except Exception:  # noqa: BLE001 - an OpInfo whose error inputs need another device
            continue
        if not errors or not claimed(info):
            continue
        for error_input in errors[:per_op]:
            if (silent := silent_on_error_input(info, error_input)) is not None:
                yield silent
