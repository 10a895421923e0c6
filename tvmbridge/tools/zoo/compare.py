"""How the zoo judges one tensor: TVM's distance to PyTorch against PyTorch's own distance to a
float64 copy (the float noise of the step), and the tensors of a model output by readable paths.
Split from ``harness`` (the protocol); ``harness`` re-exports these names."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

NOISE_FACTOR = 10.0
SCALE_TOL = 1e-6
# Under autocast the scale tolerance is a sixteenth of bfloat16's unit roundoff (2**-8), in place of
# SCALE_TOL (about 8 float32 steps at 1): eager's distance to float64 is one sample of the rounding
# noise, and a value that is a sum of bfloat16 values can land near float64 by cancellation where
# another summation order does not: qwen3's mean loss was 1.4e-6 from float64 in eager autocast
# (llama's 3.5e-5), TVM's 6.6e-5 at 5.56 with every logit within one bfloat16 step of eager's; a
# BatchNorm running mean near 0 (levit's, of three bfloat16 values near 0.3) 5.7e-6 in eager, 1.9e-4
# in TVM, an input one step apart. An error of a real cause (a dropped term, a rounding in the
# wrong place) is larger.
AUTOCAST_SCALE_TOL = 2.0**-8 / 16


@dataclass
class Mismatch:
    """A tensor outside noise: ``err`` = max|tvm - eager|, ``noise`` = max|eager - ref|."""

    step: str
    tensor: str
    err: float
    noise: float
    ref_max: float
    why: str = ""
    tvm_ref: float = 0.0  # max|tvm - ref|: TVM's own distance to float64 (vs noise: eager's)
    allowance: float = 0.0  # added to the tolerance (parameters after AdamW: see Case.train_step)
    scale_tol: float = SCALE_TOL  # times max(1, ref_max) (AUTOCAST_SCALE_TOL under autocast)
    dtype_step: float = 0.0  # times ref_max: one step of a bfloat16/float16 tensor's dtype at its largest value
    spread: float = 0.0  # max|eager' - eager|, eager' from parameters one rounding away (harness.RoundingSpread)

    @property
    def passed(self) -> bool:
        """err <= 10 * noise + 1e-6 * max(1, max|ref|) (+ the allowance, and for a tensor in a
        16-bit dtype one step of it at max|ref|: two roundings of one value may differ by that
        alone), and nothing structural differs; the noise is the larger of eager's distance to
        float64 and the rounding spread, where that was measured."""
        return not self.why and self.excess <= 1.0

    @property
    def excess(self) -> float:
        """How far beyond its tolerance (inf for a None/shape/NaN-pattern mismatch)."""
        tol = NOISE_FACTOR * max(self.noise, self.spread) + self.scale_tol * max(1.0, self.ref_max) + self.allowance
        tol += self.dtype_step * self.ref_max
        return math.inf if self.why or not math.isfinite(self.err) else self.err / tol if self.err else 0.0

    def text(self) -> str:
        what = self.why or (
            f"err={self.err:.2e} noise={self.noise:.2e} tvm-ref={self.tvm_ref:.2e} |ref|={self.ref_max:.2e}"
            + (f" spread={self.spread:.2e}" if self.spread else "")
        )
        return f"{self.step}: {self.tensor} {what}"


def named_leaves(obj: Any, prefix: str = "out", depth: int = 0, seen: set | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a model output by a readable path (``out.logits``,
    ``out.past_key_values.layers.0.keys``): ModelOutputs, tuples, dicts and cache objects."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module)) or id(obj) in seen:
        return {}
    seen.add(id(obj))
    if isinstance(obj, Mapping):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif hasattr(obj, "__dict__"):
        items = [(k, v) for k, v in vars(obj).items() if not k.startswith("_")]
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(named_leaves(value, f"{prefix}.{key}", depth + 1, seen))
    return out


def measure(
    step: str, name: str, tvm: torch.Tensor | None, eager: torch.Tensor | None, ref: torch.Tensor | None
) -> Mismatch:
    """TVM's distance to PyTorch and PyTorch's to the float64 reference (``.passed`` says whether
    it is within noise). None-ness, shapes, integers and NaN/inf places must match exactly."""
    if tvm is None or eager is None:
        if tvm is None and eager is None:
            return Mismatch(step, name, 0.0, 0.0, 0.0)
        which = "None in PyTorch, a tensor in TVM" if eager is None else "a tensor in PyTorch, None in TVM"
        return Mismatch(step, name, math.inf, 0.0, 0.0, which)
    if tvm.shape != eager.shape:
        return Mismatch(step, name, math.inf, 0.0, 0.0, f"shape {tuple(tvm.shape)} != PyTorch's {tuple(eager.shape)}")
    a, e = tvm.detach().to(torch.float64), eager.detach().to(torch.float64)
    if not eager.is_floating_point():
        err = (a - e).abs().max().item() if a.numel() else 0.0
        return Mismatch(step, name, err, 0.0, 0.0, f"integers differ by {err:g}" if err else "")
    fin_a, fin_e = torch.isfinite(a), torch.isfinite(e)
    if not torch.equal(fin_a, fin_e) or not torch.equal(a[~fin_a].nan_to_num(), e[~fin_e].nan_to_num()):
        return Mismatch(step, name, math.nan, 0.0, 0.0, "NaN/inf at other places than PyTorch's")
    if not fin_e.any():
        return Mismatch(step, name, 0.0, 0.0, 0.0)
    r64 = ref.detach().to(torch.float64) if ref is not None else e
    r32 = ref.detach().to(eager.dtype).to(torch.float64) if ref is not None else e
    both = fin_e & torch.isfinite(r32)
    err = (a - e)[fin_e].abs().max().item()
    noise = (e - r32)[both].abs().max().item() if both.any() else 0.0
    tvm_ref = (a - r32)[both].abs().max().item() if both.any() else 0.0
    finite_ref = r64[torch.isfinite(r64)]
    ref_max = finite_ref.abs().max().item() if finite_ref.numel() else 0.0
    step_of_dtype = torch.finfo(eager.dtype).eps if eager.dtype in (torch.bfloat16, torch.float16) else 0.0
    return Mismatch(step, name, err, noise, ref_max, tvm_ref=tvm_ref, dtype_step=step_of_dtype)


def compare(
    step: str, name: str, tvm: torch.Tensor | None, eager: torch.Tensor | None, ref: torch.Tensor | None
) -> Mismatch | None:
    """None when TVM's tensor is within float noise of PyTorch's, else the mismatch."""
    m = measure(step, name, tvm, eager, ref)
    return None if m.passed else m
