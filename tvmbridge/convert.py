"""Stage 1 and 3: trace a module with ``torch.export`` and convert it to a Relax ``IRModule``.

The Relax frontend is built for inference. The bridge changes three things about it:

* train-mode dropout becomes ``R.nn.dropout`` instead of identity, so that the dropout pass can
  turn it into a multiplication by a mask that PyTorch draws (``passes/dropout.py``);
* matmul-like ops keep the input dtype (the frontend fixes ``out_dtype="float32"``, which breaks
  float64);
* a converter that fails names its aten op, and ops without a converter are listed up front.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

import tvm
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .errors import ConversionError, UnsupportedOpError


@dataclass
class TracedModule:
    """What tracing learned about a module and one call signature.

    ``flat_inputs`` lists, for every leaf of the canonical ``(args, kwargs)`` of the call, either a
    tensor placeholder name or the constant the export specialised on.
    """

    exported: ExportedProgram
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    constant_leaves: dict[int, Any]
    user_input_names: list[str]  # tensor placeholders in Relax parameter order
    param_targets: list[str]  # module parameter names in Relax parameter order
    num_outputs: int


def canonical_call(
    forward: Callable | inspect.Signature, args: tuple, kwargs: dict | None
) -> tuple[tuple, dict[str, Any]]:
    """Bind a call to ``module.forward``'s signature, defaults applied, so that the same call
    written with positional or keyword arguments gives the same ``(args, kwargs)`` structure:
    positional-only and ``*args`` stay positional, named parameters become keywords in signature
    order, ``**kwargs`` entries follow sorted by name."""
    sig = forward if isinstance(forward, inspect.Signature) else inspect.signature(forward)
    try:
        bound = sig.bind(*args, **(kwargs or {}))
    except TypeError as exc:
        raise ConversionError("inputs", f"inputs do not match forward{sig}: {exc}") from None
    bound.apply_defaults()
    pos: list[Any] = []
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        param = sig.parameters[name]
        kind = param.kind
        if _is_default(value, param.default):
            continue
        if kind == inspect.Parameter.POSITIONAL_ONLY:
            pos.append(value)
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            pos.extend(value)
        elif kind == inspect.Parameter.VAR_KEYWORD:
            named.update(sorted(value.items()))
        else:
            named[name] = value
    return tuple(pos), named


def _is_default(value: Any, default: Any) -> bool:
    """An argument equal to its (non-tensor) default is dropped, so that omitting it and passing it
    explicitly give the same signature."""
    if default is inspect.Parameter.empty or isinstance(value, torch.Tensor):
        return False
    if value is default:
        return True
    return isinstance(default, (bool, int, float, str)) and type(value) is type(default) and value == default


class _FlatCall(torch.nn.Module):
    """Calls ``inner`` from the tensor leaves of one call signature, the non-tensor leaves bound as
    constants, so that the exported program has tensors only as user inputs."""

    def __init__(self, inner: torch.nn.Module, in_spec: pytree.TreeSpec, leaves: list[Any]) -> None:
        super().__init__()
        self.inner = inner
        self._spec = in_spec
        self._template = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self._slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self._template)
        for i, t in zip(self._slots, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self.inner(*args, **kwargs)


def trace(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> TracedModule:
    """Export ``module`` for one call and decompose to core ATen (the form that is converted)."""
    call_args, call_kwargs = canonical_call(module.forward, args, kwargs)
    leaves, in_spec = pytree.tree_flatten((call_args, call_kwargs))
    tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
    try:
        ep = torch.export.export(_FlatCall(module, in_spec, leaves), args=tensors, strict=False)
        ep = ep.run_decompositions()
    except Exception as exc:  # noqa: BLE001 - torch raises many types here
        raise ConversionError(
            "trace", f"torch.export could not trace {type(module).__name__}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc

    sig = ep.graph_signature
    bad = [s for s in sig.output_specs if s.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)]
    if bad:
        raise ConversionError(
            "trace",
            "the module mutates state during forward "
            f"({', '.join(f'{s.kind.name} {s.target}' for s in bad)}), e.g. BatchNorm running "
            "statistics in train mode; only functional modules can be compiled",
        )

    constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
    user_input_names = [
        s.arg.name for s in sig.input_specs
        if s.kind == InputKind.USER_INPUT and isinstance(getattr(s.arg, "name", None), str)
        and any(n.name == s.arg.name for n in ep.graph.find_nodes(op="placeholder"))
        and isinstance(_placeholder_val(ep, s.arg.name), torch.Tensor)
    ]
    if len(user_input_names) != len(tensors):
        raise ConversionError(
            "trace", f"expected {len(tensors)} tensor inputs in the export, found "
            f"{len(user_input_names)}"
        )
    param_targets = [
        s.target.removeprefix("inner.") for s in sig.input_specs if s.kind == InputKind.PARAMETER
    ]

    out_nodes = list(ep.graph.find_nodes(op="output"))[0].args[0]
    for o in out_nodes:
        if not isinstance(o, torch.fx.Node) or not isinstance(o.meta.get("val"), torch.Tensor):
            raise ConversionError(
                "trace", f"output {o!r} is not a tensor; only (nested tuples of) tensors can be "
                "returned by a compiled module"
            )
    out_spec = ep.call_spec.out_spec
    return TracedModule(
        exported=ep, in_spec=in_spec, out_spec=out_spec, constant_leaves=constants,
        user_input_names=user_input_names, param_targets=param_targets, num_outputs=len(out_nodes),
    )


def _placeholder_val(ep: ExportedProgram, name: str) -> Any:
    for n in ep.graph.find_nodes(op="placeholder"):
        if n.name == name:
            return n.meta.get("val")
    return None


_DROPOUT_OPS = ("dropout.default", "native_dropout.default", "dropout_.default")


def _is_train_dropout(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    if name not in _DROPOUT_OPS:
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
            try:
                return fn(node, *rest)
            except ConversionError:
                raise
            except Exception as exc:  # noqa: BLE001 - converters raise anything
                raise UnsupportedOpError(
                    "convert", f"the Relax frontend failed on {node.format_node()}: "
                    f"{type(exc).__name__}: {exc}", op=name,
                ) from exc
        return convert

    # --- dropout: keep it, as R.nn.dropout, when it is a training dropout -----------------------
    def _dropout_expr(self, node: torch.fx.Node) -> relax.Expr:
        x = self.env[node.args[0]]
        if not _is_train_dropout(node):
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
    """Convert the traced program to Relax; parameters stay function inputs (after user inputs), so
    optimizer updates are seen without recompiling."""
    ep = traced.exported
    missing = unsupported_ops(ep)
    if missing:
        raise UnsupportedOpError(
            "convert", f"no Relax converter for {', '.join(missing)}; add one to "
            "tvmbridge.convert.BridgeImporter or call with fallback=True to keep PyTorch",
            op=missing[0],
        )
    try:
        mod = BridgeImporter().from_exported_program(ep, True, False, False, None)
    except ConversionError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ConversionError("convert", f"{type(exc).__name__}: {exc}") from exc
    func = mod["main"]
    names = [p.name for p in func.params]
    expected = traced.user_input_names + [
        s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER
    ]
    if names != expected:
        raise ConversionError(
            "convert", f"unexpected Relax parameter order {names}, expected {expected}"
        )
    # The params attribute holds copies of the weights: the bridge passes live tensors instead.
    mod["main"] = func.without_attr("params")
    return mod
