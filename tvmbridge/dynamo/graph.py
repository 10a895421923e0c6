"""A graph dynamo hands a backend, as a module the dispatcher compiles.

Dynamo inlines the model's modules: the graph takes the parameters and buffers as inputs, next
to the call's tensors, the sizes it keeps symbolic (``s0: SymInt``) and, under
``dynamic=True``, the modules' float attributes as 0-d tensors read with ``.item()``. The
bridge compiles calls of tensors, so :class:`InputPlan` sorts the graph's inputs:

* tensors are the compiled call's tensors (a parameter's gradient flows back to it as to any
  input that requires grad; a buffer the graph writes is written back);
* a size that is a dim of an input tensor is read from that tensor (one symbolic graph serves
  every size), and the dims dynamo keeps symbolic are the ones compiled symbolically;
* any other size, and every scalar read with ``.item()``, becomes a Python number of the call:
  the compiled code is specialised on its value and guarded by it (a new value compiles anew).
"""

from __future__ import annotations

import operator
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import HigherOrderOperator

SIZE, TENSOR, SCALAR, DERIVED = "size", "tensor", "scalar", "derived"


def _expr(v: Any) -> Any:
    """A symbolic size's expression; None for a plain or constant size."""
    if not isinstance(v, torch.SymInt):
        return None
    expr = v.node.expr
    return None if expr.is_number else expr


def concrete(v: Any) -> Any:
    """A dynamo example value as the number it stands for (a SymInt's hint)."""
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return v.node.hint
    return v


@dataclass(frozen=True)
class InputPlan:
    """How each input of a dynamo graph reaches the compiled call: ``kinds[i]`` is ``tensor``,
    ``derived`` (a size read from ``sources[i] = (tensor input, dim)``), ``scalar`` (a 0-d tensor
    read with ``.item()``: passed as its value) or ``size`` (a size no input's dim carries: passed
    as an int)."""

    kinds: tuple[str, ...]
    sources: dict[int, tuple[int, int]]
    dynamic_dims: dict[int, dict[int, str]]  # call-argument position -> {dim: symbol} dynamo keeps symbolic
    symbols: dict[Any, tuple[int, int | None]] = field(
        default_factory=dict
    )  # symbol -> (input, dim or None: the input itself)

    @classmethod
    def of(cls, gm: torch.fx.GraphModule) -> InputPlan:
        """The plan of ``gm``'s inputs, from dynamo's example values on its placeholders."""
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        values = [p.meta.get("example_value", p.meta.get("val")) for p in placeholders]
        dims_of: dict[Any, tuple[int, int]] = {}
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                for d, size in enumerate(v.shape):
                    expr = _expr(size)
                    if expr is not None and expr.is_Symbol:
                        dims_of.setdefault(expr, (i, d))
        kinds, sources = [], {}
        for i, (p, v) in enumerate(zip(placeholders, values)):
            if isinstance(v, torch.SymInt) and _expr(v) in dims_of:
                kinds.append(DERIVED)
                sources[i] = dims_of[_expr(v)]
            elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
                kinds.append(SIZE)
            elif (
                isinstance(v, torch.Tensor)
                and v.dim() == 0
                and p.users
                and all(u.op == "call_method" and u.target == "item" for u in p.users)
            ):
                kinds.append(SCALAR)
            else:
                kinds.append(TENSOR)
        call_position: dict[int, int] = {}  # graph input -> position among the compiled call's arguments
        for i, kind in enumerate(kinds):
            if kind != DERIVED:
                call_position[i] = len(call_position)
        dynamic: dict[int, dict[int, str]] = {}
        for i, v in enumerate(values):
            if kinds[i] == TENSOR and isinstance(v, torch.Tensor):
                marks = {d: str(_expr(s)) for d, s in enumerate(v.shape) if _expr(s) is not None}
                if marks:
                    dynamic[call_position[i]] = marks
        symbols: dict[Any, tuple[int, int | None]] = dict(dims_of)
        symbols.update(
            {
                _expr(v): (i, None)
                for i, v in enumerate(values)
                if isinstance(v, torch.SymInt) and _expr(v) is not None and _expr(v).is_Symbol
            }
        )
        return cls(tuple(kinds), sources, dynamic, symbols)

    def size_of(self, symbol: Any, args: Any) -> int:
        """A shape symbol's value in a call of the graph."""
        i, d = self.symbols[symbol]
        return int(args[i]) if d is None else int(args[i].shape[d])

    def call_args(self, args: Any) -> list[Any]:
        """The compiled call's arguments for one call of the graph (sizes read from tensors dropped,
        scalars as numbers)."""
        out = []
        for kind, a in zip(self.kinds, args):
            if kind == TENSOR:
                out.append(a)
            elif kind == SCALAR:
                out.append(a.item())
            elif kind == SIZE:
                out.append(concrete(a))
        return out

    def dynamic_option(self) -> dict[str, dict[int, str]] | bool:
        """The dispatcher's ``dynamic`` marks: the dims dynamo keeps symbolic (none: static)."""
        return {f"arg {j}": marks for j, marks in self.dynamic_dims.items()} or False


# higher-order ops whose body is plain forward code: inlined (the bridge differentiates the body
# itself, and its capture set already trades memory for recompute as checkpointing asks)
INLINED = ("tag_activation_checkpoint", "wrap_activation_checkpoint", "wrap")


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Replace a call of a higher-order op on a body graph by the body's nodes."""
    getter = node.args[0]
    assert isinstance(getter, torch.fx.Node)  # the body's get_attr
    body = getattr(gm, str(getter.target))
    if body.graph.find_nodes(op="get_attr"):
        raise ValueError(f"the body of {node.target} reads attributes of its own; it is not inlined")
    # checkpoint's keywords (use_reentrant, context_fn, ...) choose what is saved: memory, not values
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(node.args) - 1:
        raise ValueError(f"{node.target} passes {len(node.args) - 1} values to a body of {len(placeholders)} inputs")
    val_map = dict(zip(placeholders, node.args[1:]))
    with gm.graph.inserting_before(node):
        out: Any = gm.graph.graph_copy(body.graph, val_map)  # the body's results (fx: any Argument)
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise ValueError(f"a result of {node.target} is used as a whole; it is not inlined")
        user.replace_all_uses_with(out[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    if not getter.users:
        gm.graph.erase_node(getter)


def inline_bodies(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with checkpointed or wrapped bodies inlined, in place: ``torch.export`` cannot
    retrace dynamo's checkpoint op, and the bridge's capture set already trades memory for
    recompute. Done before anything reads the graph's inputs or splits it."""
    try:
        for node in list(gm.graph.nodes):
            if (
                node.op == "call_function"
                and isinstance(node.target, HigherOrderOperator)
                and getattr(node.target, "__name__", None) in INLINED
            ):
                _inline(gm, node)
    finally:  # a body left whole is still the same program
        gm.delete_all_unused_submodules()
        gm.recompile()
    return gm


@dataclass(frozen=True)
class OutputPlan:
    """The graph's outputs the compiled code does not hand back as it computes them:

    * ``others``: outputs that are not tensors, sizes dynamo hands on to the Python after the
      graph, worked out from the call's sizes (a constant, or an expression in the shape symbols);
    * ``inputs``: outputs that *are* an input tensor (``normalize(..., out=u)``, ``x.add_(1)``
      returned: the graph wrote the input and returns it), given back as that input once the
      write is copied into it, as PyTorch gives it. The compiled code's own tensor for it may be
      memory its backward reads (TVM keeps one buffer for the value and its saved clone): handed
      out, the module kept it as its buffer and the next call's in-place write broke the backward.
    """

    count: int
    others: dict[int, Any]  # output position -> a constant or a sympy expression
    inputs: dict[int, int] = field(default_factory=dict)  # output position -> graph input position

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, plan: InputPlan) -> OutputPlan:
        outputs = list(gm.graph.find_nodes(op="output"))[0].args[0]
        if not isinstance(outputs, (tuple, list)):  # a split piece's one value
            value = outputs.meta.get("example_value") if isinstance(outputs, torch.fx.Node) else outputs
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"the graph's one output is {type(value).__name__}, not a tensor")
            return cls(1, {})
        others = {}
        for i, o in enumerate(outputs):
            value = o.meta.get("example_value") if isinstance(o, torch.fx.Node) else o
            if isinstance(value, torch.Tensor):
                continue
            expr = _expr(value) if isinstance(value, torch.SymInt) else None
            if expr is None and isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                value = concrete(value) if value.node.expr.is_number else None
            if expr is not None and not expr.free_symbols <= set(plan.symbols):
                expr = None
            if expr is None and not isinstance(value, (int, float, bool, type(None))):
                raise ValueError(
                    f"graph output {i} is {type(value).__name__} {value!r}, not a tensor or a size of the inputs"
                )
            others[i] = expr if expr is not None else value
        return cls(len(outputs), others, _returned_inputs(gm, outputs, plan))

    @property
    def rebuilt(self) -> bool:
        """Whether the compiled tensors alone are not the graph's outputs."""
        return bool(self.others or self.inputs)

    def full(self, tensors: Any, args: Any, plan: InputPlan) -> tuple:
        """The graph's outputs from the compiled tensors and the call's sizes and inputs."""
        if not self.rebuilt:
            return tuple(tensors)
        given = iter(tensors)
        out = []
        for i in range(self.count):
            if i in self.others:
                other = self.others[i]
                out.append(
                    int(other.subs({s: plan.size_of(s, args) for s in other.free_symbols}))
                    if hasattr(other, "free_symbols")
                    else other
                )
            else:
                tensor = next(given)
                out.append(args[self.inputs[i]] if i in self.inputs else tensor)
        return tuple(out)


def _returned_inputs(gm: torch.fx.GraphModule, outputs: Any, plan: InputPlan) -> dict[int, int]:
    """Output position -> input position, for each output that is a tensor input itself (dynamo's
    example values keep identity: an ``out=`` or in-place result is its input's value). Only
    inputs without a gradient: one that requires grad is not written back (see ``variants``)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    position = {
        id(v): j
        for j, (kind, p) in enumerate(zip(plan.kinds, placeholders))
        if kind == TENSOR and isinstance(v := p.meta.get("example_value"), torch.Tensor) and not v.requires_grad
    }
    return {
        i: position[id(o.meta.get("example_value"))]
        for i, o in enumerate(outputs)
        if isinstance(o, torch.fx.Node) and id(o.meta.get("example_value")) in position
    }


def _tensor_outputs_only(gm: torch.fx.GraphModule, outputs: OutputPlan) -> None:
    node = list(gm.graph.find_nodes(op="output"))[0]
    node.args = (tuple(o for i, o in enumerate(node.args[0]) if i not in outputs.others),)


def prepared(gm: torch.fx.GraphModule, plan: InputPlan, outputs: OutputPlan | None = None) -> torch.fx.GraphModule:
    """``gm`` with each scalar input's ``.item()`` replaced by the input itself (it arrives as a
    number) and only the tensor outputs returned (see :class:`OutputPlan`); a higher-order op
    left in it (a custom Function's own backward) is refused."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, HigherOrderOperator):
            raise ValueError(
                f"the graph calls {getattr(node.target, '__name__', node.target)} (a custom "
                "autograd.Function's own backward, or another higher-order op): TVM cannot run it"
            )
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for kind, p in zip(plan.kinds, placeholders):
        if kind == SCALAR:
            for user in list(p.users):
                user.replace_all_uses_with(p)
                gm.graph.erase_node(user)
    if outputs is not None and outputs.others:
        _tensor_outputs_only(gm, outputs)
    gm.recompile()
    return gm


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def source_line(graph: torch.fx.GraphModule) -> str:
    """Where the user's code made the graph's first op (``file.py:12 in step``), from the stack
    dynamo recorded; empty where it recorded none. Warnings name a graph by it."""
    for node in graph.graph.nodes:
        frames = _FRAME.findall(node.meta.get("stack_trace") or "")
        if frames:
            path, line, fn = frames[-1]
            return f"{os.path.basename(path)}:{line} in {fn}"
    return ""


class GraphCall(torch.nn.Module):
    """``graph(*inputs)`` called with the compiled call's arguments: the sizes it takes are read
    from the tensors they are dims of. ``graph`` is a submodule, so its own attributes (constant
    tensors dynamo lifted) are state the compiled code reads as inputs. ``grad_enabled``: the grad
    mode the graph runs under (dynamo guards on it; a piece of a split graph under its barrier's),
    kept inside the call, so that the trace sees it: the bridge traces with grad on, and an op only
    valid without it (``normalize(..., out=u)`` on a weight that requires grad) failed there."""

    def __init__(self, graph: torch.fx.GraphModule, plan: InputPlan, grad_enabled: bool = True) -> None:
        super().__init__()
        self.graph = graph
        self.plan = plan
        self.grad_enabled = grad_enabled
        origin = source_line(graph)
        self._tvmbridge_description = f"a torch.compile graph ({origin})" if origin else "a torch.compile graph"

    def forward(self, *args: Any) -> Any:
        """The graph on the call's arguments, its sizes filled in from the tensors."""
        full: list[Any] = []
        given = iter(args)
        for kind in self.plan.kinds:
            full.append(None if kind == DERIVED else next(given))
        for i, (j, d) in self.plan.sources.items():
            full[i] = full[j].shape[d]
        with torch.set_grad_enabled(self.grad_enabled):
            if torch.compiler.is_exporting():
                # node by node, so that each traced op records the node it came from (``from_node``):
                # a conversion failure can then name the graph's own nodes, where the backend splits
                with torch.fx.traceback.preserve_node_meta():
                    return torch.fx.Interpreter(self.graph).run(*full)
            return self.graph(*full)
