"""``x ** 2``, ``x ** 3``, ``x ** 4`` as multiplications, before the gradient.

The frontend converts ``torch.pow(x, 3.0)`` (GPT-2's ``gelu_new``, many activations and losses)
to ``relax.power(x, const 3.0)``; its legalization unpacks the scalar exponent into
``tirx.pow(x, 3.0)``, where TVM logs "Detected pow(x, y) where y >= 3 ..." to stderr every time
it builds one (dozens of lines per compile), and the kernel is a scalar libm ``pow`` that LLVM
does not vectorize. Written as products, the float32/float64 forward is what eager PyTorch computes
on CPU for 2 and 3 (ATen special-cases those exponents as ``x*x`` and ``x*x*x``) and 4 (the square
of the square) is within an ulp of eager's ``std::pow``; the gradient is the product rule's
multiplications, with no ``pow`` (nor ``log``) in the backward. Other exponents keep ``power``
(TVM still logs its line for a constant exponent of 3 or more: ``x ** 5``, ``x ** 3.5``).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax import dpl

from ..ir import cleanup

SMALL_EXPONENTS = (2, 3, 4)


_BASE, _EXPONENT = dpl.wildcard(), dpl.is_const()
POWER_BY_CONSTANT = dpl.is_op("relax.power")(_BASE, _EXPONENT)


def as_products(call: relax.Expr, matched: dict[dpl.DFPattern, relax.Expr]) -> relax.Expr:
    """A matched ``power(x, n)`` with a float ``x`` and a 0-d constant ``n`` in
    :data:`SMALL_EXPONENTS` as products; anything else unchanged."""
    x, exponent = matched[_BASE], matched[_EXPONENT]
    ty, value = getattr(x, "ty", None), exponent.value.numpy()
    if not (
        isinstance(ty, relax.TensorType)
        and str(ty.dtype).startswith(("float", "bfloat"))
        and str(ty.dtype) == str(call.ty.dtype)
        and value.ndim == 0
        and np.isfinite(value)
        and float(value) in SMALL_EXPONENTS
    ):
        return call
    mul, n = relax.op.multiply, float(value)
    if n == 4:
        square = mul(x, x)
        return mul(square, square)
    return mul(x, x) if n == 2 else mul(mul(x, x), x)


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.IntegerPowers")
def _integer_powers(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
    out = mod.clone()
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            out[gv] = dpl.rewrite_call(POWER_BY_CONSTANT, as_products, func)
    return out


def IntegerPowers() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """Every ``power`` by a small constant integer becomes multiplications (see the module), with
    TVM's pattern rewriter (``relax.dpl``); then the cleanup passes."""
    return tvm.transform.Sequential([relax.transform.Normalize(), _integer_powers, *cleanup()])
