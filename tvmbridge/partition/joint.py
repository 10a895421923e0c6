"""The joint graph: the adjoint function as named values with sizes, for the capture policy.

The adjoint (``passes.gradient``) computes outputs and gradients in one function. Its bindings
fall into two parts: the *primal* bindings (the module's own computation, which the reverse sweep emits
first) and the *adjoint* bindings it added. :class:`JointGraph` describes every value by a unique
key, its op, its inputs, its bytes and its part; the policy decides over it what to capture and
``split`` carries the decision out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import tvm
from tvm import relax

from .. import names
from ..errors import ConversionError
from ..ir import shape_at
from ..passes.gradient import GradientResult


@dataclass(frozen=True)
class JointNode:
    """One value of the adjoint as the capture policy sees it."""

    name: str
    op: str  # Relax op name, "param", "tuple", "getitem", "var" or "const"
    inputs: list[str]  # keys of the bindings/params read
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    is_forward: bool  # a primal binding (or a primal parameter)
    is_param: bool = False


@dataclass(frozen=True)
class JointGraph:
    """The adjoint as a graph of named values, in binding order (params first)."""

    nodes: dict[str, JointNode]
    forward_outputs: list[str]
    grad_outputs: list[str]
    params: list[str]  # the primal parameters
    grad_out_params: list[str]
    keys: dict[relax.Var, str] = field(repr=False)  # var -> node key
    output_vars: list[relax.Expr] = field(repr=False)  # the primal outputs inside the adjoint (vars, constants)
    # binding var -> the vars its value reads: walked once here (a TVM array walk per binding is
    # most of a large model's split when every pass over the bindings repeats it)
    reads: dict[relax.Var, list[relax.Var]] = field(repr=False)

    def backward_reads(self) -> set[str]:
        """Forward values (primal bindings, not params) that some adjoint binding reads."""
        reads: set[str] = set()
        for node in self.nodes.values():
            if not node.is_forward:
                reads.update(i for i in node.inputs if self.nodes[i].is_forward and not self.nodes[i].is_param)
        return reads

    def bytes_of(self, keys: list[str]) -> int:
        return sum(self.nodes[k].nbytes for k in keys)


def op_name(value: relax.Expr) -> str:
    if isinstance(value, relax.Call):
        return str(value.op.name) if hasattr(value.op, "name") else "call"
    if isinstance(value, relax.Tuple):
        return "tuple"
    if isinstance(value, relax.TupleGetItem):
        return "getitem"
    if isinstance(value, relax.Var):
        return "var"
    if isinstance(value, tvm.ir.expr.Constant):
        return "const"
    return type(value).__name__


def free_vars(value: relax.Expr) -> list[relax.Var]:
    """The Relax variables an expression reads (not the TIR shape variables it mentions)."""
    return [v for v in relax.analysis.free_vars(value) if not tvm.ir.is_prim_var(v)]


def tensor_info(var: relax.Expr, sizes: dict[str, int] | None = None) -> tuple[tuple[int, ...] | None, str | None, int]:
    """``(shape, dtype, bytes)`` of a tensor, symbolic dims taken at ``sizes`` (the sizes the
    compile was asked for); ``(None, dtype or None, 0)`` where there is no shape."""
    ty = var.ty
    if not (isinstance(ty, relax.TensorType) and ty.shape is not None):
        return None, None, 0
    shape = shape_at(var, sizes or {})
    if shape is None:
        return None, str(ty.dtype), 0
    dt = tvm.DataType(str(ty.dtype))
    return shape, str(ty.dtype), math.prod(shape) * max(1, dt.bits * dt.lanes // 8)


def value_keys(func: relax.Function) -> dict[relax.Var, str]:
    """A unique key per value of a one-block function: its name, suffixed ``#k`` where the name
    was taken already (params first, then bindings in order). TVM's passes reuse names (``lv``)."""
    keys: dict[relax.Var, str] = {}
    taken: set[str] = set()
    block_vars = [b.var for b in func.body.blocks[0].bindings] if func.body.blocks else []
    for var in list(func.params) + block_vars:
        k, n = var.name, 1
        while k in taken:
            n += 1
            k = f"{var.name}#{n}"
        taken.add(k)
        keys[var] = k
    return keys


def count_primal_bindings(primal: relax.Function, adjoint: relax.Function) -> int:
    """How many leading adjoint bindings are the primal ones (the reverse sweep emits them first;
    simplification may have dropped dead ones, never reordered them)."""
    primal_names = [b.var.name for b in primal.body.blocks[0].bindings]
    adjoint_names = [b.var.name for b in adjoint.body.blocks[0].bindings]
    j = 0
    for name in primal_names:
        if j < len(adjoint_names) and name == adjoint_names[j]:
            j += 1
    return j


def joint_graph(grad: GradientResult, num_primal_bindings: int, sizes: dict[str, int] | None = None) -> JointGraph:
    """Describe the adjoint for a capture policy; the first ``num_primal_bindings`` bindings are
    the forward part; symbolic sizes are costed at ``sizes``."""
    adj = grad.adjoint
    keys = value_keys(adj)
    nodes: dict[str, JointNode] = {}
    reads: dict[relax.Var, list[relax.Var]] = {}
    for p in adj.params:
        shape, dtype, nbytes = tensor_info(p, sizes)
        nodes[keys[p]] = JointNode(keys[p], "param", [], shape, dtype, nbytes, is_forward=True, is_param=True)
    for i, b in enumerate(adj.body.blocks[0].bindings):
        shape, dtype, nbytes = tensor_info(b.var, sizes)
        k = keys[b.var]
        reads[b.var] = free_vars(b.value)
        nodes[k] = JointNode(
            k,
            op_name(b.value),
            [keys[v] for v in reads[b.var]],
            shape,
            dtype,
            nbytes,
            is_forward=i < num_primal_bindings,
        )
    outputs = output_vars(adj, len(grad.differentiable), grad.repeats)
    return JointGraph(
        nodes=nodes,
        forward_outputs=[keys[v] for v in outputs if isinstance(v, relax.Var)],
        grad_outputs=[keys[g] for g in result_grads(adj)],
        params=[keys[p] for p in adj.params[: grad.num_primal_params]],
        grad_out_params=[keys[p] for p in grad.grad_out_params],
        keys=keys,
        output_vars=outputs,
        reads=reads,
    )


def output_vars(adj: relax.Function, n: int, repeats: dict[int, int] | None = None) -> list[relax.Expr]:
    """The primal outputs, found where the VJP target reads them (``vjp_prod{i} = o_i * g_i``):
    robust to the renaming and aliasing that simplification does. ``repeats``: outputs that
    return an earlier output's value (not in the target)."""
    found: dict[int, relax.Var] = {}
    for b in adj.body.blocks[0].bindings:
        i = names.vjp_prod_index(b.var.name)
        if i is not None and isinstance(b.value, relax.Call):
            found[i] = b.value.args[0]
    for i, j in (repeats or {}).items():
        if j in found:
            found[i] = found[j]
    # a constant output (an integer the trace folded from a static size) is returned as is; the
    # build gives it fresh memory at every call (``backend.fresh_results``)
    if sorted(found) != list(range(n)) or not all(
        isinstance(v, (relax.Var, tvm.ir.expr.Constant)) for v in found.values()
    ):
        raise ConversionError("split", "could not locate the module outputs in the adjoint")
    return [found[i] for i in range(n)]


def result_grads(adj: relax.Function) -> list[relax.Var]:
    """The gradient values the adjoint returns, in order."""
    result = adj.body.body
    if not (isinstance(result, relax.Tuple) and len(result.fields) == 2 and isinstance(result.fields[1], relax.Tuple)):
        raise ConversionError("split", "unexpected adjoint result layout (expected (target, (grads...)))")
    return list(result.fields[1].fields)
