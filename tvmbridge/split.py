"""Stage 5: split the adjoint into a forward and a backward function along a capture set.

The adjoint (``passes.gradient``) computes outputs and gradients in one function. Its bindings
fall into two parts: the *primal* bindings (the module's own computation) and the *adjoint*
bindings that ``Gradient`` added. The forward function runs the primal bindings and returns the
outputs plus the *captured* values; the backward function takes the captured values, the primal
parameters it reads and the output gradients, recomputes whatever primal values it needs that were
not captured, and returns the gradients.

Which values are captured is a policy (``tvmbridge.capture``) over :class:`JointGraph`; this
module only carries a choice out, and checks it is complete.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from .errors import ConversionError
from .passes._util import rebuild
from .passes.gradient import GradientResult


@dataclass
class JointNode:
    """One binding of the adjoint as the capture policy sees it."""

    name: str
    op: str  # Relax op name, "tuple", "getitem", "var" or "const"
    inputs: list[str]  # names of bindings/params read
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    is_forward: bool  # a primal binding
    is_param: bool = False


@dataclass
class JointGraph:
    """The adjoint as a graph of named values, in binding order (params first)."""

    nodes: dict[str, JointNode]
    forward_outputs: list[str]
    grad_outputs: list[str]
    params: list[str]
    grad_out_params: list[str]
    keys: dict[relax.Var, str] = field(default_factory=dict, repr=False)  # var -> node name

    def backward_reads(self) -> set[str]:
        """Forward values (primal bindings, not params) that some adjoint binding reads."""
        reads: set[str] = set()
        for node in self.nodes.values():
            if not node.is_forward:
                reads.update(i for i in node.inputs if self.nodes[i].is_forward and not self.nodes[i].is_param)
        return reads


@dataclass
class SplitResult:
    """The two halves and how values pass between them."""

    forward: relax.Function  # primal params -> (outputs..., captures...)
    backward: relax.Function  # (captures..., primal params read..., grad_outs...) -> (grads...)
    captures: list[str]
    recomputed: list[str]
    backward_param_indices: list[int]  # primal params the backward reads, by primal position
    num_outputs: int
    joint: JointGraph = field(repr=False)


def _op_name(value: relax.Expr) -> str:
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


def _free_vars(value: relax.Expr) -> list[relax.Var]:
    return list(relax.analysis.free_vars(value))


def _tensor_info(var: relax.Var) -> tuple[tuple[int, ...] | None, str | None, int]:
    ty = var.ty
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        try:
            shape = tuple(int(s) for s in ty.shape)
        except (TypeError, ValueError):
            return None, str(ty.dtype), 0
        dtype = str(ty.dtype)
        n = 1
        for s in shape:
            n *= s
        return shape, dtype, n * _dtype_bytes(dtype)
    return None, None, 0


def _dtype_bytes(dtype: str) -> int:
    import tvm

    dt = tvm.DataType(dtype)
    return max(1, dt.bits * dt.lanes // 8)


def value_keys(func: relax.Function) -> dict[relax.Var, str]:
    """A unique key per value of a one-block function: its name, suffixed ``#k`` where the name
    was taken already (params first, then bindings in order)."""
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


def joint_graph(grad: GradientResult, num_primal_bindings: int) -> JointGraph:
    """Describe the adjoint for a capture policy.

    Relax names need not be unique (TVM's passes reuse ``lv``), so every value gets a unique key:
    its name, suffixed ``#k`` where the name was already taken. ``Gradient`` emits the primal
    bindings first, unchanged: the first ``num_primal_bindings`` bindings are the forward part.
    """
    adj = grad.adjoint
    block = adj.body.blocks[0]
    nodes: dict[str, JointNode] = {}
    keys = value_keys(adj)

    for p in adj.params:
        shape, dtype, nbytes = _tensor_info(p)
        k = keys[p]
        nodes[k] = JointNode(k, "param", [], shape, dtype, nbytes, is_forward=True, is_param=True)
    for i, b in enumerate(block.bindings):
        shape, dtype, nbytes = _tensor_info(b.var)
        inputs = [keys[v] for v in _free_vars(b.value)]
        k = keys[b.var]
        nodes[k] = JointNode(
            k, _op_name(b.value), inputs, shape, dtype, nbytes, is_forward=i < num_primal_bindings
        )
    grads = _result_grads(adj)
    grad.output_vars = _outputs(adj, len(grad.grad_out_params))
    joint = JointGraph(
        nodes=nodes,
        forward_outputs=[keys[v] for v in grad.output_vars],
        grad_outputs=[keys[g] for g in grads],
        params=[keys[p] for p in adj.params[: grad.num_primal_params]],
        grad_out_params=[keys[p] for p in grad.grad_out_params],
    )
    joint.keys = keys
    return joint


def _outputs(adj: relax.Function, n: int) -> list[relax.Var]:
    """The primal outputs, found where the VJP target reads them (``vjp_prod{i} = o_i * g_i``):
    robust to the renaming and aliasing that simplification does."""
    found: dict[int, relax.Var] = {}
    for b in adj.body.blocks[0].bindings:
        name = b.var.name
        if name.startswith("vjp_prod") and isinstance(b.value, relax.Call):
            found[int(name[len("vjp_prod"):])] = b.value.args[0]
    if sorted(found) != list(range(n)) or not all(isinstance(v, relax.Var) for v in found.values()):
        raise ConversionError("split", "could not locate the module outputs in the adjoint")
    return [found[i] for i in range(n)]


def _result_grads(adj: relax.Function) -> list[relax.Var]:
    result = adj.body.body
    if not (isinstance(result, relax.Tuple) and len(result.fields) == 2 and isinstance(result.fields[1], relax.Tuple)):
        raise ConversionError("split", "unexpected adjoint result layout (expected (target, (grads...)))")
    return list(result.fields[1].fields)


def _closure(needed: set[relax.Var], value_of: dict[relax.Var, relax.Expr], stop: set[relax.Var]) -> set[relax.Var]:
    """All bound vars needed to compute ``needed`` from ``stop`` values and params."""
    out: set[relax.Var] = set()
    stack = list(needed)
    while stack:
        v = stack.pop()
        if v in out or v in stop or v not in value_of:
            continue
        out.add(v)
        stack.extend(_free_vars(value_of[v]))
    return out


def split(grad: GradientResult, joint: JointGraph, captures: list[str]) -> SplitResult:
    """Build the forward and backward functions for ``captures`` (keys of primal values)."""
    adj = grad.adjoint
    bindings = list(adj.body.blocks[0].bindings)
    value_of = {b.var: b.value for b in bindings}
    var_of = {k: v for v, k in joint.keys.items()}
    primal_params = list(adj.params[: grad.num_primal_params])
    for c in captures:
        node = joint.nodes.get(c)
        if node is None or not node.is_forward or node.is_param:
            raise ConversionError("split", f"capture {c!r} is not a primal value")
    cap_vars = [var_of[c] for c in captures]
    is_fwd = {var_of[k]: n.is_forward for k, n in joint.nodes.items()}

    # Backward: the adjoint bindings the grads need, then the primal values they read, recomputed
    # from captures (and params) unless captured themselves.
    grad_vars = _result_grads(adj)
    primal_vars = {v for v in value_of if is_fwd[v]}
    adjoint_part = _closure(set(grad_vars), value_of, stop=primal_vars)
    primal_reads = {fv for v in adjoint_part for fv in _free_vars(value_of[v]) if fv in primal_vars}
    primal_reads |= {g for g in grad_vars if g in primal_vars}
    recompute = _closure(primal_reads, value_of, stop=set(cap_vars))
    used = set(primal_reads)
    for v in recompute:
        used.update(_free_vars(value_of[v]))
    cap_vars = [v for v in cap_vars if v in used]  # unused captures are dropped

    # Forward: outputs and captures.
    outs = list(grad.output_vars)
    fwd_set = _closure(set(outs) | set(cap_vars), value_of, stop=set())
    fwd_bindings = [b for b in bindings if b.var in fwd_set]
    fields = outs + cap_vars
    fwd_result = relax.Var("forward_result", relax.TupleType([v.ty for v in fields]))
    fwd_bindings.append(relax.VarBinding(fwd_result, relax.Tuple(fields)))
    forward = rebuild(adj, primal_params, fwd_bindings, fwd_result, attrs={"global_symbol": "forward"})

    # Backward params: captured values, primal params read, output grads.
    body = [b for b in bindings if b.var in adjoint_part or b.var in recompute]
    reads: set[relax.Var] = set()
    for b in body:
        reads.update(_free_vars(b.value))
    bwd_param_idx = [i for i, p in enumerate(primal_params) if p in reads]
    cap_params = [relax.Var(f"saved_{v.name}", v.ty) for v in cap_vars]
    bwd_bindings: list[relax.Binding] = [relax.VarBinding(v, p) for v, p in zip(cap_vars, cap_params)]
    bwd_bindings += body
    bound = {b.var for b in body} | set(cap_vars) | set(adj.params)
    unresolved = reads - bound
    if unresolved:
        raise ConversionError(
            "split", f"backward reads values neither captured nor recomputed: {sorted(v.name for v in unresolved)}"
        )
    bwd_result = relax.Var("backward_result", relax.TupleType([g.ty for g in grad_vars]))
    bwd_bindings.append(relax.VarBinding(bwd_result, relax.Tuple(grad_vars)))
    backward = rebuild(
        adj,
        cap_params + [primal_params[i] for i in bwd_param_idx] + list(grad.grad_out_params),
        bwd_bindings,
        bwd_result,
        attrs={"global_symbol": "backward"},
    )
    return SplitResult(
        forward=forward,
        backward=backward,
        captures=[joint.keys[v] for v in cap_vars],
        recomputed=[joint.keys[b.var] for b in bindings if b.var in recompute],
        backward_param_indices=bwd_param_idx,
        num_outputs=len(outs),
        joint=joint,
    )
