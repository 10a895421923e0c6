"""What a dispatched module's calls did, for ``explain()`` and for warning once per reason.

The hot path only counts and keeps the variant it ran: the wording happens when someone asks.
"""

from __future__ import annotations

import collections
import threading
import warnings
from typing import TYPE_CHECKING

from ..backend.gemm_choice import summary as gemm_summary
from ..errors import FallbackWarning, caller_stacklevel, module_name

if TYPE_CHECKING:
    from .guards import Mismatch
    from .variants import Variant


class CallLog:
    """Counters, the reasons PyTorch ran, the variants discarded, and the keys already warned of."""

    def __init__(self) -> None:
        self.calls_tvm = 0
        self.calls_fallback = 0
        self.fallback_reasons: collections.Counter[str] = collections.Counter()
        self.discarded: list[str] = []  # why variants were dropped (failed, or disagreed with PyTorch)
        self.last_decision: Variant | str = "not called yet"
        self.warned: set[str] = set()
        self.lock = threading.Lock()

    def ran_compiled(self, variant: Variant) -> None:
        with self.lock:
            self.calls_tvm += 1
            variant.calls += 1
        self.last_decision = variant

    def ran_pytorch(self, reason: Mismatch) -> bool:
        """Count a call PyTorch ran; whether its reason is new (to be warned of)."""
        with self.lock:
            self.calls_fallback += 1
            self.fallback_reasons[reason.message] += 1
        self.last_decision = f"ran PyTorch: {reason.message}"
        return self.first_time(reason.key)

    def fell_back(self, module: object, reason: Mismatch, warn: bool) -> None:
        """Count a call PyTorch ran, with a ``FallbackWarning`` the first time for its reason."""
        if self.ran_pytorch(reason) and warn:
            warnings.warn(
                f"tvmbridge: fell back to PyTorch for {module_name(module)}: {reason.message}",
                FallbackWarning,
                stacklevel=caller_stacklevel(),
            )

    def compiled_call_refused(self, variant: Variant) -> None:
        """A compiled call whose value checks failed (PyTorch ran it): not counted as compiled."""
        with self.lock:
            self.calls_tvm -= 1
            variant.calls -= 1

    def pytorch_gradients(self, message: str) -> None:
        """Count a backward whose gradients are PyTorch's (a compiled forward's check undecided)."""
        with self.lock:
            self.fallback_reasons[message] += 1

    def first_time(self, key: str) -> bool:
        """Whether ``key`` is new; it is not from now on."""
        with self.lock:
            new = key not in self.warned
            self.warned.add(key)
        return new

    def discarded_variant(self, reason: Mismatch) -> None:
        with self.lock:
            self.discarded.append(reason.message)
        self.last_decision = f"ran PyTorch: {reason.message}"

    def explain(self, name: str, variants: tuple[Variant, ...]) -> str:
        """What the last call did and why, and how often each path ran."""
        last = self.last_decision
        if not isinstance(last, str):
            number = f"variant {variants.index(last) + 1}" if last in variants else "a discarded variant"
            last = f"ran the compiled code ({number}: {last.label})"
        lines = [f"{name}: last call {last}", f"calls: {self.calls_tvm} compiled, {self.calls_fallback} PyTorch"]
        for i, v in enumerate(variants, 1):
            lines.append(
                f"  variant {i} ({v.label}): {v.calls} calls, compiled in "
                f"{v.compiled.seconds_total():.1f}s ({v.compiled.parts_built()}) because: {v.why}; "
                f"GEMMs: {gemm_summary(list(v.compiled.gemm_choices))}"
            )
        lines += [f"  {n} x PyTorch: {reason}" for reason, n in self.fallback_reasons.most_common()]
        lines += [f"  discarded: {why}" for why in self.discarded]
        return "\n".join(lines)
