"""The safety net: the first call of every compiled variant is checked against PyTorch itself.

However many cases the tests name, a compiler meets graphs nobody tried. So a new variant does
not earn trust from its compile: its first call runs PyTorch's forward too, on the same tensors
with the generator rewound (the same dropout masks), and compares every output and updated
buffer; the first backward of a call that needs gradients compares every gradient (a ``None``
where PyTorch gives one, or the reverse, counts) with PyTorch's for the same incoming gradients.
Only then is the variant trusted. A mismatch beyond float noise discards the variant; that call
returns PyTorch's values, so even the step that found the bug is right.

"Float noise" is judged per tensor against a scale: ``|got - want| <= atol + rtol * scale``,
with ``rtol`` from the dtype and ``scale`` the tensor's largest magnitude (not each element's:
a sum's cancellation makes small elements noisy), but at least ``GROUP_FLOOR`` of the largest
magnitude among its group (all outputs, or all gradients, of the call): the noise of a sum is
relative to the terms summed, and a gradient that cancels to nearly zero (LayerNorm's weight under
a uniform output gradient) carries the noise of its terms. It is a net for real bugs (a swapped
input, a wrong gradient formula, an aliased buffer), not a proof of bitwise equality.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .upstream import leaves_upstream

# relative to the tensor's largest magnitude; float noise of a whole model stays well inside
RTOL = {torch.float64: 1e-7, torch.float32: 1e-3, torch.bfloat16: 4e-2, torch.float16: 2e-2}
ATOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-3}
GROUP_FLOOR = 1e-2


@dataclass(frozen=True)
class Discrepancy:
    """The worst tensor of a comparison: its name, what differed, and by how much."""

    name: str
    detail: str
    excess: float  # error over tolerance (> 1: a mismatch); inf for a structural difference
    # a gradient outside the tolerance in a call whose rounding alone moves PyTorch's own gradients
    # beyond it: the call cannot tell the bridge's error from rounding (see GradientCheck.check)
    unsettled: bool = False

    def __str__(self) -> str:
        return f"{self.name}: {self.detail}"


def own_inputs(tensors: list[torch.Tensor], num_user: int) -> list[torch.Tensor]:
    """The call's tensors for a PyTorch forward whose gradients are the call's own (partial) ones:
    each call argument that requires grad as a fresh alias (``view_as``; one per tensor).
    Differentiated with respect to the tensors themselves, an argument computed from another (a
    piece fed ``h`` and ``f(h)``) also got the gradient that flows through the other, outside the
    call, and autograd walked (and freed) the graph before the call. The aliases keep that graph
    reachable for a double backward. The module's state (from ``num_user`` on) stays itself where
    it is a leaf, for the forward swaps it into the module, where another thread reading
    ``module.parameters()`` would see the alias; but for a parameter with its own hooks
    (``weight.register_hook``), which would run on the reference too (a right variant compared
    with the hooked gradient and discarded, the hook run twice where the reference stands in).
    State made by a graph outside the call (old-style weight_norm's ``weight``, made from the
    parameters ``weight_g`` and ``weight_v`` before each call) is a leaf of its own: the call's
    gradients stop at it, and autograd takes them on through that graph once, after the call.
    A leaf the call's arguments were themselves computed from is an alias as well
    (``upstream.leaves_upstream``: an LM head's weight tied to the embedding)."""
    tied = leaves_upstream(tensors[:num_user], tensors[num_user:])
    seen: dict[int, torch.Tensor] = {}
    return [
        seen.setdefault(id(t), t.view_as(t) if i < num_user or t.grad_fn is None else t.detach().requires_grad_())
        if t.requires_grad and (i < num_user or t.grad_fn is not None or t._backward_hooks or id(t) in tied)
        else t
        for i, t in enumerate(tensors)
    ]


def _magnitude(t: torch.Tensor | None) -> float:
    if t is None or t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return 0.0
    finite = t.detach()[torch.isfinite(t.detach())]
    return float(finite.abs().max()) if finite.numel() else 0.0


def compare(
    name: str,
    got: torch.Tensor | None,
    want: torch.Tensor | None,
    floor: float = 0.0,
    precision: torch.dtype | None = None,
) -> Discrepancy | None:
    """Why ``got`` is not ``want`` to float noise (None: it is); ``floor``: the least scale;
    ``precision``: the dtype the call computed in where coarser than the tensor's (autocast)."""
    if got is None or want is None:
        if got is None and want is None:
            return None
        return Discrepancy(
            name,
            f"{'None' if got is None else 'a tensor'} where PyTorch gives {'None' if want is None else 'a tensor'}",
            float("inf"),
        )
    if got.shape != want.shape or got.dtype != want.dtype:
        return Discrepancy(
            name, f"{tuple(got.shape)} {got.dtype} where PyTorch gives {tuple(want.shape)} {want.dtype}", float("inf")
        )
    got, want = got.detach(), want.detach()
    if not (want.is_floating_point() or want.is_complex()):
        bad = int((got != want).sum())
        return Discrepancy(name, f"{bad} elements differ", float("inf")) if bad else None
    if want.numel() == 0:
        return None
    inf = torch.isinf(want)
    if (
        not torch.equal(torch.isnan(got), torch.isnan(want))
        or not torch.equal(torch.isinf(got), inf)
        or not torch.equal(got[inf], want[inf])
    ):
        return Discrepancy(name, "NaN/inf at other places than PyTorch's", float("inf"))
    finite = torch.isfinite(want)
    g, w = got[finite].double(), want[finite].double()
    if g.numel() == 0:
        return None
    err = float((g - w).abs().max())
    tol = tolerance(want.dtype, precision, max(float(w.abs().max()), floor))
    if err <= tol:
        return None
    return Discrepancy(
        name,
        f"max abs error {err:.3g} where the largest value is {float(w.abs().max()):.3g} (tolerance {tol:.2g})",
        err / tol,
    )


def tolerance(dtype: torch.dtype, precision: torch.dtype | None, scale: float) -> float:
    """The float noise allowed a tensor of ``dtype`` and largest magnitude ``scale`` computed at
    ``precision`` (the coarser of the two counts)."""
    dtypes = [dtype] if precision is None else [dtype, precision]
    return max(ATOL.get(d, 1e-6) for d in dtypes) + max(RTOL.get(d, 1e-3) for d in dtypes) * scale


def worst(
    pairs: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]], precision: torch.dtype | None = None
) -> Discrepancy | None:
    """The worst discrepancy over ``(name, got, want)`` pairs, or None when all agree."""
    floor = GROUP_FLOOR * max((_magnitude(want) for _, _, want in pairs), default=0.0)
    found = [d for name, got, want in pairs if (d := compare(name, got, want, floor, precision)) is not None]
    return max(found, key=lambda d: d.excess) if found else None


@dataclass
class Trust:
    """How far a variant has been checked against PyTorch: the outputs of its training part (a
    call that needs gradients) and their gradients (at its first backward), and the outputs of
    its inference part (a no_grad call): the two parts are different kernels."""

    outputs: bool = False
    gradients: bool = False
    infer_outputs: bool = False
    unsettled: int = 0  # backwards whose gradient check could not decide (too ill-conditioned)
    # held while a call is checked: threads making the same first call are checked one after
    # another (a stateful module's check compares the buffers it writes, which a concurrent
    # checked call would move), and a call that waited and finds the check done runs as trusted
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def needed(self, needs_grad: bool) -> bool:
        if needs_grad:
            return not self.outputs or not self.gradients
        return not self.infer_outputs

    def outputs_agreed(self, needs_grad: bool) -> None:
        if needs_grad:
            self.outputs = True
        else:
            self.infer_outputs = True


@dataclass
class GradientCheck:
    """What the first backward of a checked call compares against: PyTorch's differentiable
    outputs of the same call (their graph reaches the same input tensors), and where to report."""

    eager_outputs: list[torch.Tensor | None]  # per compiled output; None where not differentiable
    inputs: list[torch.Tensor]  # per call tensor: what PyTorch's outputs were computed from (see own_inputs)
    names: list[str]  # per call tensor (the call's, then the module's state)
    on_result: Callable[[Discrepancy | None], None]
    precision: torch.dtype | None = None  # autocast's dtype: the gradients carry its rounding
    # run only if a gradient is outside the tolerance: the same call's outputs in full precision
    # (autocast off, or float32 in float64; same masks), the values to judge it against again
    reference: Callable[[], list[torch.Tensor | None] | None] | None = None
    # run only if one is still outside it: PyTorch's outputs of the call at the call's precision
    # from inputs one rounding away (same masks), a sample of how far rounding moves its gradients
    shaken: Callable[[], list[torch.Tensor | None] | None] | None = None

    def eager_gradients(
        self, needs: tuple[bool, ...], grad_outputs: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """PyTorch's gradients of the call's inputs for ``grad_outputs`` (its own graph, consumed)."""
        return _gradients(self.eager_outputs, self.inputs, needs, grad_outputs)

    def check(
        self,
        got: list[torch.Tensor | None],
        want: list[torch.Tensor | None],
        needs: tuple[bool, ...],
        grad_outputs: list[torch.Tensor | None] | None = None,
    ) -> Discrepancy | None:
        """The worst gradient outside float noise. Eager's own gradients may be further from
        the exact ones than the tolerance: under autocast (rounding at every op, where the
        compiled code accumulates in float32), and in an ill-conditioned float32 step (train-mode
        BatchNorm over a few values per channel amplifies rounding beyond any fixed tolerance).
        A gradient outside it is judged again against the full-precision run, and passes if it
        is within the tolerance of that, or at least as close to it as eager's own is; failing
        that, if rounding alone moves PyTorch's own gradient further than the tolerance
        (:func:`_within_rounding_spread`). A gradient still outside, in a call where rounding
        alone moves any of PyTorch's gradients beyond the tolerance, is reported ``unsettled``:
        this call cannot decide, the caller uses PyTorch's gradients and checks a later call."""
        got = onfirst_slots(got, self.inputs)  # one tensor passed twice: its gradient is the sum
        pairs = [(f"gradient of {name}", g, w) for name, g, w, need in zip(self.names, got, want, needs) if need]
        found = worst(pairs, self.precision)
        if found is None or self.reference is None or grad_outputs is None:
            return found
        exact = self._judged_gradients(self.reference, needs, grad_outputs)
        if exact is None:
            return found
        floor = GROUP_FLOOR * max((_magnitude(w) for _, _, w in pairs), default=0.0)
        left = [
            (name, g, w)
            for name, g, w in pairs
            if compare(name, g, w, floor, self.precision) is not None
            and not _excused(name, g, w, exact.get(name), floor, self.precision)
        ]
        shaken = self._judged_gradients(self.shaken, needs, grad_outputs) if left and self.shaken else None
        if shaken is not None:
            left = [
                (name, g, w)
                for name, g, w in left
                if not _within_rounding_spread(g, w, shaken.get(name), exact.get(name), floor, self.precision)
            ]
        reports = [
            _with_reference(d, g, w, exact.get(name), None if shaken is None else shaken.get(name))
            for name, g, w in left
            if (d := compare(name, g, w, floor, self.precision)) is not None
        ]
        if not reports:
            return None
        found = max(reports, key=lambda d: d.excess)
        moved = None if shaken is None else _moved_by_rounding(pairs, shaken, floor, self.precision)
        if moved is None or found.excess == float("inf"):
            return found
        return Discrepancy(found.name, f"{found.detail}; rounding alone moves PyTorch's {moved}", found.excess, True)

    def _judged_gradients(
        self,
        outputs_of: Callable[[], list[torch.Tensor | None] | None] | None,
        needs: tuple[bool, ...],
        grad_outputs: list[torch.Tensor | None],
    ) -> dict[str, torch.Tensor | None] | None:
        """The gradients, by name, through the outputs another run of the call gives (None: none)."""
        outputs = outputs_of() if outputs_of is not None else None
        if outputs is None:
            return None
        widened = [g.to(o.dtype) if g is not None and o is not None else g for o, g in zip(outputs, grad_outputs)]
        grads = _gradients(outputs, self.inputs, needs, widened)
        return {f"gradient of {name}": r for name, r, need in zip(self.names, grads, needs) if need}


def _with_reference(
    found: Discrepancy,
    got: torch.Tensor | None,
    want: torch.Tensor | None,
    exact: torch.Tensor | None,
    shaken: torch.Tensor | None = None,
) -> Discrepancy:
    """``found`` with both gradients' distance to the full-precision one (and, where sampled,
    how far rounding moved PyTorch's own): where PyTorch's own is of the same size (an
    ill-conditioned call: BatchNorm over a few values per channel, under autocast), the report
    shows the call's noise next to the bridge's."""
    if got is None or want is None or exact is None or got.shape != exact.shape or got.numel() == 0:
        return found
    bridge, eager = _distance(got, exact), _distance(want, exact)
    detail = f"{found.detail}; from the full-precision call's: compiled {bridge:.3g}, PyTorch's own {eager:.3g}"
    if shaken is not None and shaken.shape == want.shape:
        detail += f" (PyTorch's from inputs one rounding away: {_distance(shaken, want):.3g} from its own)"
    return Discrepancy(found.name, detail, found.excess)


# how far from the full-precision value eager's own output may be for that run to judge the
# output (further, the two runs are not the same computation: a random op drawing otherwise)
REFERENCE_REACH = 16.0


def same_computation(
    pairs: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]], precision: torch.dtype | None
) -> bool:
    """Whether another run's outputs (``got``) are eager's (``want``) up to ``REFERENCE_REACH``
    tolerances each, as a run of the same call at another precision is, even an ill-conditioned
    one; not so where a random op drew otherwise."""
    floor = GROUP_FLOOR * max((_magnitude(want) for _, _, want in pairs), default=0.0)
    return all(
        (d := compare(name, got, want, floor, precision)) is None or d.excess <= REFERENCE_REACH
        for name, got, want in pairs
    )


def rejudged_outputs(
    pairs: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]],
    exact: Sequence[torch.Tensor | None],
    precision: torch.dtype | None,
) -> Discrepancy | None:
    """The worst of ``(name, got, want)`` still outside the tolerance once each is judged again
    against the same call in full precision (``exact``, per pair) as gradients are
    (:func:`_excused`): a forward can be as ill-conditioned (LeViT's classifier BatchNorm1d over
    a batch of 2: eager's own running variance 0.011 from float64's, at a tolerance of 0.0041).
    Only where eager's own value lies within ``REFERENCE_REACH`` tolerances of the exact one."""
    floor = GROUP_FLOOR * max((_magnitude(want) for _, _, want in pairs), default=0.0)
    left = []
    for (name, got, want), x in zip(pairs, exact):
        found = compare(name, got, want, floor, precision)
        if found is None:
            continue
        if (
            found.excess != float("inf")
            and x is not None
            and want is not None
            and x.shape == want.shape
            and torch.isfinite(x).all()
            and same_computation([(name, x.to(want.dtype), want)], precision)
        ):
            if _excused(name, got, want, x, floor, precision):
                continue
            found = _with_reference(found, got, want, x)
        left.append(found)
    return max(left, key=lambda d: d.excess) if left else None


def _excused(
    name: str,
    got: torch.Tensor | None,
    want: torch.Tensor | None,
    exact: torch.Tensor | None,
    floor: float,
    precision: torch.dtype | None,
) -> bool:
    """Whether ``got`` is the full-precision gradient ``exact`` to the call's tolerance, or at
    least as close to it as eager's own ``want`` is, up to that tolerance (never a structural
    difference): two roundings of an ill-conditioned call (T5's ReLU gates under bfloat16
    autocast, 15% from float32 in eager itself) land on either side of each other, and the one
    further from exact by less than the float noise the check allows anywhere is no bug. Nothing
    looser: a variant is trusted for every later call of its shape, and a gradient bug can hide
    inside an ill-conditioned first call's noise (regnet's did, at twice eager's error)."""
    if got is None or want is None or exact is None or got.shape != exact.shape or got.dtype != want.dtype:
        return False
    if compare(name, got, exact.to(got.dtype), floor, precision) is None:
        return True
    g, w, x = got.detach().double(), want.detach().double(), exact.detach().double()
    if not (torch.isfinite(g).all() and torch.isfinite(w).all() and torch.isfinite(x).all()):
        return False
    allowed = tolerance(want.dtype, precision, max(float(w.abs().max()), floor))
    return _distance(g, x) <= _distance(w, x) + allowed


# how many times eager's own distance to the full-precision gradient a compiled one may be, in a
# call that rounding alone moves further than the tolerance
ROUNDING_SPREAD = 2.0


def _within_rounding_spread(
    got: torch.Tensor | None,
    want: torch.Tensor | None,
    shaken: torch.Tensor | None,
    exact: torch.Tensor | None,
    floor: float,
    precision: torch.dtype | None,
) -> bool:
    """Whether the call is too ill-conditioned to tell ``got`` from rounding: PyTorch's own
    gradient from inputs one rounding away (``shaken``) differs from ``want`` by more than the
    tolerance, and ``got`` is no further from the full-precision ``exact`` than
    ``ROUNDING_SPREAD`` times eager's own distance to it. A deep CNN's train-mode BatchNorms
    over a few values per channel (DLA at 64x64) amplify float32 rounding so; the same compile
    in float64 then matches PyTorch's float64 to 1e-14. The shaken run is evidence of the
    ill-conditioning, never the bound: in a chaotic call it lands as far from ``exact`` as the
    compiled one (timm's HRNet: both 0.042, eager 2e-5; there the compiled one was right), and
    so would a gradient bug, on a variant trusted for every later call: such a call leaves the
    check unsettled instead (``Discrepancy.unsettled``). In a well-conditioned call the two
    PyTorch runs agree and nothing is excused here."""
    if got is None or want is None or shaken is None or exact is None:
        return False
    tensors = (got, want, shaken, exact)
    if len({(t.shape, t.dtype) for t in tensors[:3]}) != 1 or exact.shape != got.shape:
        return False
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        return False
    allowed = tolerance(want.dtype, precision, max(float(want.abs().max()), floor))
    if _distance(shaken, want) <= allowed:
        return False
    return _distance(got, exact) <= ROUNDING_SPREAD * _distance(want, exact) + allowed


def _moved_by_rounding(
    pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]],
    shaken: dict[str, torch.Tensor | None],
    floor: float,
    precision: torch.dtype | None,
) -> str | None:
    """Which of PyTorch's gradients its own run from inputs one rounding away moves beyond the
    tolerance, worded (None: none does). Such a call is chaotic at this point (ReLU gates and
    BatchNorm statistics over a few values flip with the last bit: timm's HRNet and DPN at 64x64
    and batch 3, where PyTorch's own float32 gradient jumps between values 10% apart from inputs
    moved by 1e-7, and the bridge's float64 compile matches PyTorch's float64 to 1e-13), so no
    single call can tell a gradient bug from rounding there."""
    for name, _, want in pairs:
        other = shaken.get(name)
        if want is None or other is None or other.shape != want.shape or not torch.isfinite(other).all():
            continue
        if (d := compare(name, other, want, floor, precision)) is not None:
            return str(d)
    return None


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest elementwise difference, in float64."""
    return float((a.detach().double() - b.detach().double()).abs().max())


def _gradients(
    outputs: list[torch.Tensor | None],
    inputs: list[torch.Tensor],
    needs: tuple[bool, ...],
    grad_outputs: list[torch.Tensor | None],
) -> list[torch.Tensor | None]:
    """The gradients of ``inputs`` (where needed) through ``outputs``' graph (consumed); a tensor
    passed at several places gets its whole gradient at the first (autograd adds the gradients of
    a Function's inputs that are one tensor: a whole gradient at each place counts it twice)."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o is not None and g is not None and o.requires_grad]
    first = first_slots(inputs)
    wanted = [i for i, need in enumerate(needs) if need and first[i] == i]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    if not pairs or not wanted:
        return result
    with torch.enable_grad():
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs], allow_unused=True
        )
    for i, g in zip(wanted, grads):
        result[i] = g
    return result


def first_slots(inputs: Sequence[torch.Tensor]) -> list[int]:
    """Per input, the first place the same tensor object is passed at (``m(x, x)``; a graph
    piece fed one tensor twice)."""
    seen: dict[int, int] = {}
    return [seen.setdefault(id(t), i) for i, t in enumerate(inputs)]


def onfirst_slots(grads: list[torch.Tensor | None], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``grads`` with the gradients of one tensor passed at several places added at the first
    place and None at the others: what autograd accumulates into it, in the form ``_gradients``
    gives PyTorch's (the compiled code may give the whole gradient at any one place, or parts)."""
    first = first_slots(inputs)
    if first == list(range(len(first))):
        return grads
    out: list[torch.Tensor | None] = [None] * len(grads)
    for i, g in enumerate(grads):
        j, kept = first[i], out[first[i]]
        if g is not None:
            out[j] = g if kept is None else kept + g
    return out
