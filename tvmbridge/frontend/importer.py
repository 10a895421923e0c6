"""Convert an exported program to a Relax ``IRModule`` with the bridge's converters.

The Relax frontend is built for inference. The bridge changes three things about it:

* train-mode dropout becomes ``R.nn.dropout`` instead of identity, so that the dropout pass can
  turn it into a multiplication by a mask that PyTorch draws (``passes/dropout.py``);
* matmul-like ops keep the input dtype (the frontend fixes ``out_dtype="float32"``, which breaks
  float64);
* a converter that fails names its aten op, and ops without a converter are listed up front.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import tvm
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .. import names
from ..errors import ConversionError, UnsupportedOpError, stage_errors
from .export import TracedModule

_DROPOUT_OPS = ("dropout.default", "native_dropout.default", "dropout_.default")


def is_train_dropout(node: torch.fx.Node) -> bool:
    """A dropout that drops something: train mode and ``p > 0``."""
    if getattr(node.target, "__name__", "") not in _DROPOUT_OPS:
        return False
    p = float(node.args[1])
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return bool(train) and p > 0.0


class BridgeImporter(ExportedProgramImporter):
    """The Relax frontend with the bridge's converters (training dropout, dtype-preserving matmul)
    and errors that name the aten op."""

    def create_convert_map(self) -> dict[str, Callable]:
        table = super().create_convert_map()
        table.update({
            "dropout.default": self._dropout_value,
            "dropout_.default": self._dropout_value,
            "native_dropout.default": self._dropout_expr,
            "matmul.default": self._matmul,
            "mm.default": self._matmul,
            "bmm.default": self._matmul,
            "addmm.default": self._addmm_keep_dtype,
            "linear.default": self._linear_keep_dtype,
        })
        return {name: self._named(name, fn) for name, fn in table.items()}

    @staticmethod
    def _named(name: str, fn: Callable) -> Callable:
        def convert(node: torch.fx.Node, *rest: Any) -> Any:
            with stage_errors("convert", op=name, what=f"the Relax frontend failed on {node.format_node()}",
                              error=UnsupportedOpError):
                return fn(node, *rest)
        return convert

    # --- dropout: keep it, as R.nn.dropout, when it is a training dropout -----------------------
    def _dropout_expr(self, node: torch.fx.Node) -> relax.Expr:
        x = self.env[node.args[0]]
        if not is_train_dropout(node):
            return relax.Tuple([x, x])
        return self.block_builder.emit(relax.op.nn.dropout(x, rate=float(node.args[1])))

    def _dropout_value(self, node: torch.fx.Node) -> relax.Expr:
        out = self._dropout_expr(node)
        if isinstance(out, relax.Tuple):
            return out.fields[0]
        return self.block_builder.emit(relax.TupleGetItem(out, 0))

    # --- matmuls in the input's dtype -----------------------------------------------------------
    def _matmul(self, node: torch.fx.Node) -> relax.Var:
        a, b = self.env[node.args[0]], self.env[node.args[1]]
        return self.block_builder.emit(relax.op.matmul(a, b, out_dtype=str(a.ty.dtype)))

    def _addmm_keep_dtype(self, node: torch.fx.Node) -> relax.Var:
        bias, a, b = (self.env[n] for n in node.args[:3])
        alpha = node.kwargs.get("alpha", 1)
        beta = node.kwargs.get("beta", 1)
        dtype = str(a.ty.dtype)
        bb = self.block_builder
        res = bb.emit(relax.op.matmul(a, b, out_dtype=dtype))
        if alpha != 1:
            res = bb.emit(relax.op.multiply(res, relax.const(alpha, dtype)))
        if beta == 0:
            return res
        if beta != 1:
            bias = bb.emit(relax.op.multiply(bias, relax.const(beta, dtype)))
        return bb.emit(relax.op.add(bias, res))

    def _linear_keep_dtype(self, node: torch.fx.Node) -> relax.Var:
        args = self.retrieve_args(node)
        bias = args[2] if len(args) > 2 else None
        return self.block_builder.emit(relax.op.linear(args[0], args[1], bias, str(args[0].ty.dtype)))


def unsupported_ops(ep: ExportedProgram) -> list[str]:
    """aten ops in the graph that the importer has no converter for."""
    known = BridgeImporter().convert_map
    return sorted({
        n.target.__name__ for n in ep.graph.nodes
        if n.op == "call_function" and n.target.__name__ not in known
    })


def to_relax(traced: TracedModule) -> tvm.IRModule:
    """Convert the traced program to Relax (function ``names.MAIN``); parameters stay function
    inputs (after user inputs), so optimizer updates are seen without recompiling."""
    ep = traced.exported
    missing = unsupported_ops(ep)
    if missing:
        raise UnsupportedOpError(
            "convert", f"no Relax converter for {', '.join(missing)}; add one to "
            "tvmbridge.frontend.importer.BridgeImporter or call with fallback=True to keep PyTorch",
            op=missing[0],
        )
    with stage_errors("convert"):
        mod = BridgeImporter().from_exported_program(ep, True, False, False, None)
    func = mod[names.MAIN]
    params = [p.name for p in func.params]
    expected = traced.user_input_names + [
        s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER
    ]
    if params != expected:
        raise ConversionError("convert", f"unexpected Relax parameter order {params}, expected {expected}")
    # The params attribute holds copies of the weights: the bridge passes live tensors instead.
    mod[names.MAIN] = func.without_attr("params")  # a module of our own, fresh from the frontend
    return mod
