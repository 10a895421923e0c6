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

from ..ir import is_op, rewrite_and_clean

SMALL_EXPONENTS = (2, 3, 4)


def _scalar_exponent(expr: relax.Expr, bound: dict) -> float | None:
    """The exponent's value where it is a 0-d constant (so it broadcasts nothing)."""
    if isinstance(expr, relax.Var):
        expr = bound.get(expr, expr)
    if not isinstance(expr, tvm.ir.expr.Constant):
        return None
    value = expr.value.numpy()
    return float(value) if value.ndim == 0 and np.isfinite(value) else None


def integer_power(value: relax.Expr, bound: dict) -> relax.Expr | None:
    """``power(x, n)`` with a float ``x`` and a constant ``n`` in :data:`SMALL_EXPONENTS`: products."""
    if not is_op(value, "relax.power") or getattr(value, "ty", None) is None:
        return None
    x, exponent = value.args
    ty = getattr(x, "ty", None)
    if not (
        isinstance(ty, relax.TensorType)
        and str(ty.dtype).startswith(("float", "bfloat"))
        and str(ty.dtype) == str(value.ty.dtype)
    ):
        return None
    n = _scalar_exponent(exponent, bound)
    if n not in SMALL_EXPONENTS:
        return None
    mul = relax.op.multiply
    if n == 4:
        square = mul(x, x)
        return mul(square, square)
    return mul(x, x) if n == 2 else mul(mul(x, x), x)


def IntegerPowers() -> tvm.transform.Pass:  # noqa: N802 - TVM's convention for pass constructors
    """Every ``power`` by a small constant integer becomes multiplications (see the module)."""
    return rewrite_and_clean([integer_power])
