"""Tell a wrong conversion from numerical noise: run the module through TVM in double precision.

In float32 TVM and PyTorch differ by summation order (~1e-6 relative), which can hide a real
error of the same size. In float64 that noise shrinks to ~1e-14 while a wrong conversion (a
formula swapped for an approximation, a wrong axis) stays where it was. :func:`check_double`
compiles float64 copies of the module and inputs with the bridge, runs them and PyTorch with the
same dropout masks (both draw from PyTorch's generator under one seed) and the same output
gradient, and compares every output and every gradient, in float64 and, for scale, in float32.
On a deviation it localizes the first op that deviates: the traced graph runs in PyTorch and
in TVM with every intermediate value as an output (eval mode, so no randomness), and the first
value in graph order whose float64 error is above the tolerance names the op, its module and
its source line.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..options import CompileOptions, with_overrides
from .localize import first_deviation, plain_copy

# relative error still called noise, in units of the coarsest dtype's epsilon, for a model that
# computes below float64 inside (a sum's rounding grows with its length)
COARSER_NOISE = 100


@dataclass(frozen=True)
class TensorError:
    """Max abs and relative (to the reference's max abs) error of one output or gradient."""

    name: str
    abs64: float
    rel64: float
    abs32: float
    rel32: float


@dataclass
class DoubleCheckReport:
    """Per output and gradient errors; ``verdict`` is ``"noise"`` or ``"deviation"``."""

    errors: list[TensorError]
    tolerance: float
    verdict: str
    worst: list[str] = field(default_factory=list)
    first_deviation: str | None = None
    computes_in: torch.dtype = torch.float64  # the coarsest float dtype the float64 copy computes in

    @property
    def max_rel64(self) -> float:
        return max((e.rel64 for e in self.errors), default=0.0)

    def __str__(self) -> str:
        lines = [f"{'tensor':40s} {'float64 abs':>12s} {'float64 rel':>12s} {'float32 abs':>12s} {'float32 rel':>12s}"]
        for e in self.errors:
            lines.append(f"{e.name[:40]:40s} {e.abs64:12.2e} {e.rel64:12.2e} {e.abs32:12.2e} {e.rel32:12.2e}")
        if self.computes_in != torch.float64:
            lines.append(
                f"the model computes in {str(self.computes_in).replace('torch.', '')} inside (its own casts): "
                f"float64 shows that precision's noise, the tolerance is {self.tolerance:.0e}"
            )
        if self.verdict == "noise":
            lines.append(f"verdict: numerical noise (every float64 relative error <= {self.tolerance:.0e})")
        else:
            lines.append(
                f"verdict: DEVIATION (float64 relative error above {self.tolerance:.0e}) in " + ", ".join(self.worst)
            )
            lines.append(f"first deviating op: {self.first_deviation or 'none in the forward: the backward deviates'}")
        return "\n".join(lines)


def _float(x: Any, dtype: torch.dtype) -> Any:
    return x.detach().to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _step(module: torch.nn.Module, args: tuple, kwargs: dict, seed: int = 1) -> dict[str, torch.Tensor]:
    """Outputs and gradients (float inputs and parameters) of one forward+backward under ``seed``
    with a fixed random output gradient."""
    args = tuple(
        a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )
    torch.manual_seed(seed)
    outs = [o for o in pytree.tree_leaves(module(*args, **kwargs)) if isinstance(o, torch.Tensor)]
    gen = torch.Generator().manual_seed(seed + 1)
    diff = [o for o in outs if o.requires_grad]
    grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff]
    torch.autograd.backward(diff, grads)
    values = {f"output{i}": o.detach() for i, o in enumerate(outs)}
    values.update({f"input{i}.grad": a.grad for i, a in enumerate(args) if getattr(a, "grad", None) is not None})
    values.update({f"{n}.grad": p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None})
    module.zero_grad(set_to_none=True)
    return values


def _errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Max abs error and relative error per tensor. Relative to the tensor's largest value, but
    never to less than 1e-3 of the largest value of any compared tensor: a gradient that is zero
    in exact arithmetic (a key bias under softmax) holds only rounding residue, and its error
    relative to that residue says nothing."""
    if got.keys() != want.keys():
        raise RuntimeError(f"TVM and PyTorch give different tensors: {sorted(got.keys() ^ want.keys())}")
    scales = {k: want[k].double().abs().max().item() if want[k].numel() else 0.0 for k in want}
    floor = 1e-3 * max(scales.values(), default=0.0)
    out = {}
    for k in want:
        a, b = got[k].double(), want[k].double()
        err = (a - b).abs().max().item() if b.numel() else 0.0
        scale = max(scales[k], floor)
        out[k] = (err, err / scale if scale > 0 else err)
    return out


def _compare(
    module: torch.nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype, opts: CompileOptions
) -> tuple[dict[str, tuple[float, float]], torch.dtype]:
    """Errors per tensor, and the coarsest float dtype the compiled copy computes in."""
    from ..runtime.dispatch import add_tvm_dispatch, dispatcher_of

    tvm_module = plain_copy(module).to(dtype)  # a dispatched module: its own code is checked
    ref = copy.deepcopy(tvm_module)
    args = tuple(_float(a, dtype) for a in args)
    kwargs = {k: _float(v, dtype) for k, v in kwargs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=_fallback_warning())
        add_tvm_dispatch(tvm_module, args, kwargs, options=opts)
        got = _step(tvm_module, args, kwargs)
    variants = dispatcher_of(tvm_module).variants
    coarsest = [v.compiled.traced.coarsest_float or dtype for v in variants]
    return _errors(got, _step(ref, args, kwargs)), max(coarsest, key=lambda d: torch.finfo(d).eps, default=dtype)


def _fallback_warning() -> type[Warning]:
    from ..errors import FallbackWarning

    return FallbackWarning


def check_double(
    module: torch.nn.Module,
    sample_inputs: Any = (),
    sample_kwargs: dict | None = None,
    tolerance: float = 1e-10,
    options: CompileOptions | None = None,
    **overrides: Any,
) -> DoubleCheckReport:
    """Compare the bridge with PyTorch in float64 and float32 (see the module docstring). The
    module is not changed (copies are compiled). ``tolerance``: the largest float64 relative
    error still called noise."""
    # the check compares with PyTorch itself: the dispatch's own first-call check would discard a
    # deviating compile before it could be measured and localized
    opts = with_overrides(options, overrides).replace(verify=False)
    args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    kwargs = dict(sample_kwargs or {})
    e64, computes_in = _compare(module, args, kwargs, torch.float64, opts)
    e32, _ = _compare(module, args, kwargs, torch.float32, opts)
    if computes_in != torch.float64:  # a float64 model with float32 inside has float32's noise there
        tolerance = max(tolerance, COARSER_NOISE * torch.finfo(computes_in).eps)
    errors = [TensorError(k, *e64[k], *e32.get(k, (float("nan"), float("nan")))) for k in e64]
    bad = sorted((e for e in errors if e.rel64 > tolerance), key=lambda e: -e.rel64)
    report = DoubleCheckReport(
        errors, tolerance, "deviation" if bad else "noise", [e.name for e in bad[:5]], computes_in=computes_in
    )
    if bad:
        report.first_deviation = first_deviation(module, args, kwargs, tolerance, opts)
    return report
