"""Convert an exported program to a Relax ``IRModule`` with the bridge's converters.

The Relax frontend is built for inference. The bridge replaces the converters it would get
silently wrong for training, adds those it lacks and refuses what neither converts exactly
(``converters/``, by family); every failure names its aten op and where it came from.
:class:`BridgeImporter` is the frontend with that table and the state the converters share
(random sites, index-range flags, the shape symbols); :func:`to_relax` checks the graph
(``checks``), converts it, and appends the flags (and probes) to the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import tvm
from torch.export import ExportedProgram
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .. import names
from ..errors import ConversionError, UnsupportedOpError, stage_errors
from ..ir import end_open_blocks, only_dataflow_block, rebuild
from ..sizes import sympy_to_tir
from .bool_ops import BoolsAsIntegers
from .checks import refuse_unconvertible
from .converters import bind as bind_converters
from .converters.random import DROPOUT_OPS, convert_random, is_random
from .export import TracedModule
from .provenance import origins
from .sites import RandomSite
from .value_branches import feeds_only_assertions


@dataclass(frozen=True)
class Converted:
    """The Relax module and what the runtime needs to call it: the random inputs to draw and how
    many index-range flags follow the other outputs."""

    mod: tvm.IRModule
    random_sites: tuple[RandomSite, ...]
    num_index_checks: int
    probes: tuple[str, ...] = ()  # fx node names of the probed values (to_relax(probe=True))


class BridgeImporter(ExportedProgramImporter):
    """The Relax frontend with the bridge's converters and errors that name the aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.random_sites: list[RandomSite] = []
        self.index_checks: list[relax.Expr] = []
        self.range_flag_slot: int | None = None  # where take and x[idx] fold their flags
        self.symbols: dict[str, tvm.tirx.Var] = {}  # torch's shape symbols as the frontend named them
        self.item_tensors: dict[tvm.tirx.Var, relax.Expr] = {}  # a value read from a tensor -> that tensor

    @staticmethod
    def _has_assert_async(graph_module: torch.fx.GraphModule) -> bool:
        """Never: the bridge converts ``_assert_async`` into the range flag (a check after the
        call), so the function stays one pure dataflow block (the frontend's asserts made it
        impure, which the later passes refuse: ``F.one_hot`` checks its classes so)."""
        return False

    @staticmethod
    def _convert_pytorch_tensor_to_tvm(tensor_value: torch.Tensor) -> tvm.runtime.Tensor:
        """A constant of the graph (a lifted tensor constant, a buffer bound in) held on the CPU,
        as TVM's passes expect: a CUDA-resident ``relax.Constant`` cannot be hashed (every
        structural comparison fails on it) and the VM moves constants to the device itself."""
        return ExportedProgramImporter._convert_pytorch_tensor_to_tvm(tensor_value.detach().cpu())

    def create_input_vars(self, exported_program: ExportedProgram) -> tuple:
        made = super().create_input_vars(exported_program)
        for var in [*made[0].values(), *made[1].values()]:
            for dim in var.ty.shape:
                if isinstance(dim, tvm.tirx.Var):
                    self.symbols[dim.name] = dim
        return made

    def _process_derived_symbol(self, expr: Any, table: dict) -> tuple:
        """An input size that is a SymInt specialised to a number (dynamo's graph hands on a size
        it has since fixed) is that number: TVM's frontend made it a variable named ``66``,
        which no call binds."""
        if getattr(expr, "is_number", False):
            return str(expr), tvm.tirx.IntImm("int64", int(expr))
        return super()._process_derived_symbol(expr, table)

    def prim(self, dim: int | torch.SymInt) -> int | tvm.tirx.PrimExpr:
        """A traced dimension as Relax writes it: an int, or the TIR expression of its symbol."""
        if isinstance(dim, int):
            return dim
        return sympy_to_tir(dim.node.expr, self.symbols)

    def create_convert_map(self) -> dict[str, Callable]:
        """TVM's table with the registered converters over it (``converters``), each failure named."""
        table = super().create_convert_map()
        table.update(bind_converters(self, table))
        return {name: self._named(name, fn) for name, fn in table.items()}

    @staticmethod
    def _named(name: str, fn: Callable) -> Callable:
        """``fn`` with its failures as errors that name the aten op and where it came from."""

        def convert(node: torch.fx.Node, *rest: Any) -> Any:
            try:
                with stage_errors(
                    "convert",
                    op=name,
                    what=f"the Relax frontend failed on {node.format_node()}",
                    error=UnsupportedOpError,
                ):
                    return fn(node, *rest)
            except ConversionError as exc:
                exc.sources = exc.sources or origins([node])
                raise

        return convert

    def random_input(self, site: RandomSite, dtype: str, shape: list) -> relax.Var:
        """A marker for the ``len(random_sites)``-th random input (``passes.random`` makes it a
        function parameter)."""
        index = len(self.random_sites)
        self.random_sites.append(site)
        return self.block_builder.emit(
            relax.op.call_pure_packed(
                names.RANDOM_SITE, relax.prim_value(index), ty_args=relax.TensorType(shape, dtype)
            )
        )

    def _item(self, node: torch.fx.Node) -> relax.Expr:
        """``t.item()`` as the frontend reads it, and the tensor it read, kept for conditions on
        the value (``converters.indexing.assert_scalar``)."""
        source = self.env[node.args[0]]
        if feeds_only_assertions(node) and source.ty.dtype not in ("int64", "int32", "int16", "int8", "uint8"):
            # a bool or float read that only decides a branch (``value_branches``): a symbol the
            # assertions name, read back as its tensor (a float compared as a float)
            wide = "float64" if "float" in str(source.ty.dtype) else "int64"
            value = tvm.tirx.Var(f"{node.name}_value", wide)
            self.item_tensors[value] = self.block_builder.emit(relax.op.reshape(relax.op.astype(source, wide), [1]))
            return value
        value = super()._item(node)
        if isinstance(value, tvm.tirx.Var):
            self.item_tensors[value] = self.block_builder.emit(relax.op.reshape(relax.op.astype(source, "int64"), [1]))
        return value

    def range_flag(self, inside: relax.Expr) -> None:
        """Fold ``all(inside)`` into one index-range flag for every ``take``/``x[idx]``: separate
        flags of equal index tensors would be equal outputs, which dedup merges."""
        bb, op = self.block_builder, relax.op
        flag = bb.emit(op.min(op.astype(inside, "int32")))
        if self.range_flag_slot is None:
            self.range_flag_slot = len(self.index_checks)
            self.index_checks.append(flag)
        else:
            self.index_checks[self.range_flag_slot] = bb.emit(op.minimum(self.index_checks[self.range_flag_slot], flag))


def to_relax(traced: TracedModule, converters: tuple = (), probe: bool = False) -> Converted:
    """Convert the traced program to Relax (function ``names.MAIN``): every input a parameter
    (the call's tensors, then the module's state), the outputs followed by one int32 flag per
    embedding (1: all indices were in range). ``converters``: (aten overload name, fn(node,
    importer)) pairs that replace the bridge's. ``probe``: also return every intermediate float
    tensor, after the flags (their fx node names in ``Converted.probes``)."""
    ep = traced.exported
    refuse_unconvertible(ep)
    importer = BridgeImporter()
    random_ops = {
        n.target.__name__
        for n in ep.graph.nodes
        if n.op == "call_function" and is_random(n) and n.target.__name__ not in DROPOUT_OPS
    }
    custom = {
        name: importer._named(name, lambda node, _importer: convert_random(importer, node)) for name in random_ops
    }
    custom.update({name: importer._named(name, fn) for name, fn in converters})
    with stage_errors("convert"):
        try:
            mod = importer.from_exported_program(ep, True, False, False, custom)
        except BaseException:  # the builder TVM's frontend made for this program, left mid-function
            end_open_blocks(importer.block_builder)
            raise
    mod = BoolsAsIntegers()(mod)  # TVM's code generation has no arithmetic of its bool type
    func = mod[names.MAIN]
    if len(func.params) != traced.num_user_inputs + len(traced.state.names):
        raise ConversionError("convert", f"unexpected Relax parameters {[p.name for p in func.params]}")
    func = func.without_attr("params")  # copies of the weights: the bridge passes live tensors
    probes = _probe_values(ep, importer.env, func) if probe else []
    if importer.index_checks or probes:
        func = _append_outputs(func, importer.index_checks + [v for _, v in probes])
    mod[names.MAIN] = func  # a module of our own, fresh from the frontend
    return Converted(mod, tuple(importer.random_sites), len(importer.index_checks), tuple(n for n, _ in probes))


def _probe_values(ep: ExportedProgram, env: dict, func: relax.Function) -> list[tuple[str, relax.Var]]:
    """(fx node name, Relax variable) of every non-empty float tensor the graph computes, in graph
    order, where the variable is a value of ``func``'s block."""
    bound = {b.var for b in only_dataflow_block(func, "convert").bindings}
    out = []
    for node in ep.graph.nodes:
        val, var = node.meta.get("val"), env.get(node)
        if (
            node.op == "call_function"
            and isinstance(val, torch.Tensor)
            and val.is_floating_point()
            and val.numel()
            and var is not None
            and var in bound
            and isinstance(var.ty, relax.TensorType)
        ):
            out.append((node.name, var))
    return out


def _append_outputs(func: relax.Function, extra: list[relax.Expr]) -> relax.Function:
    """``func`` returning its output tuple's fields and then ``extra`` (values of its block)."""
    block = only_dataflow_block(func, "convert")
    result = func.body.body
    value = {b.var: b.value for b in block.bindings}.get(result, result)
    fields = list(value.fields) if isinstance(value, relax.Tuple) else [result]
    out = relax.Var("outputs_and_checks", relax.TupleType([f.ty for f in fields + extra]))
    bindings = list(block.bindings) + [relax.VarBinding(out, relax.Tuple(fields + extra))]
    return rebuild(func, list(func.params), bindings, out)
