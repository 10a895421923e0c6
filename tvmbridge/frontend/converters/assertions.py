"""Run-time checks on a call's values, compiled as flags: a check that fails sends the call to
PyTorch, which raises (or, for a branch the sample did not take, computes) as it does.

``_assert_async`` (a decomposition's range check), ``_assert_scalar`` on a value read from a
tensor (XLM's ``assert lengths.max().item() <= slen``, ``torch._check``, and a Python branch on a
tensor's values as the sample took it: ``frontend.value_branches``), with the symbolic logic torch
writes between the read and the assertion (``sym_ite``, ``sym_not``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import tvm
from tvm import relax

from ...errors import UnsupportedOpError
from .registry import args_of, converter

if TYPE_CHECKING:
    from ..importer import BridgeImporter


def _prim(importer: BridgeImporter, value: object) -> object:
    """A symbolic value as its TIR expression (a Relax variable names the prim value it binds)."""
    if isinstance(value, relax.Var):  # a TIR variable is one too, bound to nothing
        bound = importer.block_builder.lookup_binding(value)
        return value if bound is None else bound
    return value


@converter("sym_not")
def sym_not(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``not`` of a condition on read values (a branch torch decided as the sample went)."""
    return importer.block_builder.emit(
        relax.prim_value(tvm.tirx.Not(_as_bool(_prim(importer, importer.env[args_of(node)[0]]))))
    )


@converter("sym_ite")
def sym_ite(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``a if cond else b`` on read values (torch writes ``sym_ite(flag, 1, 0)`` for a bool read)."""
    cond, a, b = (_prim(importer, importer.env[x]) if isinstance(x, torch.fx.Node) else x for x in args_of(node)[:3])
    return importer.block_builder.emit(relax.prim_value(tvm.tirx.Select(_as_bool(cond), a, b)))


def _as_bool(expr: object) -> tvm.ir.Expr:
    if isinstance(expr, bool):
        return tvm.tirx.const(expr, "bool")
    dtype = str(getattr(getattr(expr, "ty", None), "dtype", "bool"))
    if isinstance(expr, tvm.ir.Expr) and dtype != "bool":
        return tvm.tirx.NE(expr, tvm.tirx.const(0, dtype))
    return expr


@converter("_assert_async.default", "_assert_async.msg")
def assert_async(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """A data-dependent check a decomposition writes (``F.one_hot``'s class range), folded into
    the range flag: the call raises after it as PyTorch would (the frontend's ``assert_op``
    made the function impure)."""
    condition = importer.env[args_of(node)[0]]
    importer.range_flag(relax.op.astype(condition, "bool"))
    return condition


@converter("_assert_scalar.default")
def assert_scalar(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr | None:
    """A condition on a value read from a tensor that the forward asserts (XLM's
    ``assert lengths.max().item() <= slen``, ``torch._check``), which export keeps as a run-time
    assertion: folded into the range flag, so a call that breaks it runs PyTorch, which raises as
    it does (the frontend dropped it: the compiled call returned numbers where PyTorch raised)."""
    condition = _prim(importer, importer.env[args_of(node)[0]])  # the prim value it names
    if isinstance(condition, (bool, int, tvm.tirx.IntImm)):
        return None  # decided while tracing (a false one raised there)
    if not (isinstance(condition, tvm.ir.Expr) and tvm.ir.is_prim_expr(condition)):
        raise UnsupportedOpError("convert", f"a run-time assertion on {condition!r}", op="_assert_scalar.default")
    importer.range_flag(_as_tensor(importer, condition))
    return None


_TENSOR_OPS: dict[type, Callable] = {
    tvm.tirx.Add: relax.op.add,
    tvm.tirx.Sub: relax.op.subtract,
    tvm.tirx.Mul: relax.op.multiply,
    tvm.tirx.FloorDiv: relax.op.floor_divide,
    tvm.tirx.FloorMod: relax.op.floor_mod,
    tvm.tirx.Min: relax.op.minimum,
    tvm.tirx.Max: relax.op.maximum,
    tvm.tirx.LT: relax.op.less,
    tvm.tirx.LE: relax.op.less_equal,
    tvm.tirx.GT: relax.op.greater,
    tvm.tirx.GE: relax.op.greater_equal,
    tvm.tirx.EQ: relax.op.equal,
    tvm.tirx.NE: relax.op.not_equal,
    tvm.tirx.And: relax.op.logical_and,
    tvm.tirx.Or: relax.op.logical_or,
}


def _as_tensor(importer: BridgeImporter, expr: tvm.ir.Expr) -> relax.Expr:
    """A condition over values read from tensors (and input sizes) as tensor ops on those tensors:
    the value's symbol is defined by a cast in the forward only, where the split and the backward
    would not find it, while its tensor is an ordinary value."""
    if isinstance(expr, tvm.tirx.IntImm):
        return relax.const(int(expr.value), "int64")  # compared with int64 values, or a constant truth
    if isinstance(expr, tvm.tirx.FloatImm):
        return relax.const(float(expr.value), "float64")  # compared with a float read as float64
    if isinstance(expr, tvm.tirx.Var):
        if expr in importer.item_tensors:
            return importer.item_tensors[expr]
        if (bound := importer.block_builder.lookup_binding(expr)) is not None:  # an emitted prim value
            return _as_tensor(importer, bound)
        # an input's size: defined wherever the inputs are, a one-element tensor of its value
        return importer.block_builder.emit(relax.op.arange(expr, expr + 1, 1, "int64"))
    if isinstance(expr, tvm.tirx.Select):
        condition = relax.op.astype(_as_tensor(importer, expr.condition), "bool")
        chosen = relax.op.where(
            condition, _as_tensor(importer, expr.true_value), _as_tensor(importer, expr.false_value)
        )
        return importer.block_builder.emit(chosen)
    if isinstance(expr, tvm.tirx.Not):
        return importer.block_builder.emit(relax.op.logical_not(_as_tensor(importer, expr.a)))
    make = _TENSOR_OPS.get(type(expr))
    if make is None:
        raise UnsupportedOpError("convert", f"a run-time assertion on {expr}", op="_assert_scalar.default")
    return importer.block_builder.emit(make(_as_tensor(importer, expr.a), _as_tensor(importer, expr.b)))
