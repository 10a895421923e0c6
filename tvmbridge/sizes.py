"""Symbolic sizes at a call's sizes: the two forms a traced size takes, evaluated side by side.

A size the trace left symbolic reaches the runtime in one of two forms, and each has its evaluator:

* :func:`evaluate_dims`: the text of a torch shape-environment expression (``"2*s0"``), as the
  frontend records sizes in :class:`~tvmbridge.frontend.sites.RandomSite` and the guards record
  input dims (``runtime/guards.py``). Those are sympy expressions (torch's ``FloorDiv`` and
  friends included), kept as text so the records are plain data; sympy evaluates them, cached.
* :func:`evaluate_dim`: a Relax dimension, a TIR ``PrimExpr`` over the function's shape vars
  (``n + 1``), as the passes and the backend read shapes off Relax types. Walked directly: no
  sympy, no text, and the vars are TIR objects, not names in torch's expression language.

One cannot serve the other without converting each expression into the other's language first
(:func:`sympy_to_tir` does it one way, for the frontend, and fails on what TIR cannot write),
which would cost more than either evaluation. Neither imports TVM or sympy until it is used, so
the runtime's guards can import this module without loading either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .errors import UnsupportedOpError


def evaluate_dims(dims: tuple[int | str, ...], sizes: dict[str, int]) -> tuple[int, ...]:
    """Traced sizes (ints, and sympy expressions as text) at a call's symbol values."""
    key = tuple(sorted(sizes.items()))
    return tuple(d if isinstance(d, int) else _evaluate(d, key) for d in dims)


@functools.lru_cache(maxsize=4096)
def _evaluate(expr: str, sizes: tuple[tuple[str, int], ...]) -> int:
    import sympy

    return int(sympy.sympify(expr).subs(dict(sizes)))


@functools.cache
def _tir_ops() -> dict[Any, Callable[[int, int], int]]:  # TVM's TIR node classes (untyped)
    import tvm

    return {
        tvm.tirx.Add: lambda a, b: a + b,
        tvm.tirx.Sub: lambda a, b: a - b,
        tvm.tirx.Mul: lambda a, b: a * b,
        tvm.tirx.FloorDiv: lambda a, b: a // b,
        tvm.tirx.FloorMod: lambda a, b: a % b,
        tvm.tirx.Max: max,
        tvm.tirx.Min: min,
    }


def evaluate_dim(dim: Any, sizes: dict[str, int]) -> int:
    """A Relax dimension (an int or a TIR expression over shape vars) at the given sizes."""
    if isinstance(dim, int):
        return dim
    import tvm

    if isinstance(dim, tvm.tirx.IntImm):
        return int(dim.value)
    if tvm.ir.is_prim_var(dim):
        if dim.name not in sizes:
            raise KeyError(f"no size for the shape variable {dim.name}")
        return sizes[dim.name]
    for kind, fn in _tir_ops().items():
        if isinstance(dim, kind):
            return fn(evaluate_dim(dim.a, sizes), evaluate_dim(dim.b, sizes))
    raise ValueError(f"cannot evaluate the dimension {dim}")


def sympy_to_tir(expr: Any, symbols: dict[str, Any]) -> Any:
    """A size expression of torch's shape environment as TIR over the frontend's shape vars
    (``symbols``: name -> ``tvm.tirx.Var``)."""
    import sympy
    import tvm

    if isinstance(expr, sympy.Integer):
        return tvm.tirx.IntImm("int64", int(expr))
    if isinstance(expr, sympy.Symbol):
        if str(expr) not in symbols:
            raise UnsupportedOpError("convert", f"the size {expr} is not a dimension of an input", op="shape")
        return symbols[str(expr)]
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        parts = [sympy_to_tir(a, symbols) for a in expr.args]
        out = parts[0]
        for part in parts[1:]:
            out = out + part if isinstance(expr, sympy.Add) else out * part
        return out
    raise UnsupportedOpError("convert", f"the symbolic size {expr} (only sums and products of input dims)", op="shape")
