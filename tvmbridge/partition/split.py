"""Split the adjoint into a forward and a backward function along a capture set.

The forward function runs the primal bindings and returns the outputs plus the *captured* values;
the backward function takes the captured values, the primal parameters it reads and the output
gradients, recomputes whatever primal values it needs that were not captured, and returns the
gradients. Which values are captured is the policy's choice (``policy``); this module carries it
out and checks it is complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import relax

from .. import names
from ..errors import ConversionError
from ..ir import rebuild
from ..passes.gradient import GradientResult
from .joint import JointGraph, result_grads


@dataclass(frozen=True)
class SplitResult:
    """The two halves and how values pass between them."""

    forward: relax.Function  # primal params -> (outputs..., captures...)
    backward: relax.Function  # (captures..., primal params read..., grad_outs...) -> (grads...)
    captures: list[str]
    recomputed: list[str]
    backward_param_indices: list[int]  # primal params the backward reads, by primal position
    num_outputs: int
    joint: JointGraph = field(repr=False)
    size_symbols: tuple[str, ...] = ()  # the backward's last parameter: these sizes of the call, as a shape


def _closure(needed: set[relax.Var], reads: dict[relax.Var, list[relax.Var]], stop: set[relax.Var]) -> set[relax.Var]:
    """All bound vars needed to compute ``needed`` from ``stop`` values and params (``reads``:
    each bound var's inputs, ``JointGraph.reads``)."""
    out: set[relax.Var] = set()
    stack = list(needed)
    while stack:
        v = stack.pop()
        if v in out or v in stop or v not in reads:
            continue
        out.add(v)
        stack.extend(reads[v])
    return out


@dataclass(frozen=True)
class _BackwardPart:
    adjoint: set[relax.Var]  # adjoint bindings the grads need
    recompute: set[relax.Var]  # primal bindings recomputed from captures
    captures: list[relax.Var]  # captures the backward actually reads


def _backward_part(adj: relax.Function, joint: JointGraph, cap_vars: list[relax.Var]) -> _BackwardPart:
    """The adjoint bindings the grads need, then the primal values they read, recomputed from
    captures (and params) unless captured themselves; unused captures are dropped."""
    of = joint.reads
    primal_vars = {v for v in of if joint.nodes[joint.keys[v]].is_forward}
    grad_vars = result_grads(adj)
    adjoint_part = _closure(set(grad_vars), of, stop=primal_vars)
    reads = {fv for v in adjoint_part for fv in of[v] if fv in primal_vars}
    reads |= {g for g in grad_vars if g in primal_vars}
    recompute = _closure(reads, of, stop=set(cap_vars))
    used = set(reads)
    for v in recompute:
        used.update(of[v])
    return _BackwardPart(adjoint_part, recompute, [v for v in cap_vars if v in used])


def split(grad: GradientResult, joint: JointGraph, captures: list[str]) -> SplitResult:
    """Build the forward and backward functions for ``captures`` (keys of primal values)."""
    adj = grad.adjoint
    var_of = {k: v for v, k in joint.keys.items()}
    for c in captures:
        node = joint.nodes.get(c)
        if node is None or not node.is_forward or node.is_param:
            raise ConversionError("split", f"capture {c!r} is not a primal value")
    part = _backward_part(adj, joint, [var_of[c] for c in captures])
    primal_params = list(adj.params[: grad.num_primal_params])
    forward = _forward_function(adj, joint, primal_params, part.captures)
    backward, bwd_param_idx = _backward_function(adj, grad, joint, primal_params, part)
    bindings = adj.body.blocks[0].bindings
    return SplitResult(
        forward=forward,
        backward=backward,
        captures=[joint.keys[v] for v in part.captures],
        recomputed=[joint.keys[b.var] for b in bindings if b.var in part.recompute],
        backward_param_indices=bwd_param_idx,
        num_outputs=len(joint.output_vars),
        size_symbols=tuple(v.name for v in size_symbols(primal_params)),
        joint=joint,
    )


def _forward_function(
    adj: relax.Function, joint: JointGraph, params: list[relax.Var], captures: list[relax.Var]
) -> relax.Function:
    bindings = list(adj.body.blocks[0].bindings)
    outs = list(joint.output_vars)
    needed = _closure({v for v in outs if isinstance(v, relax.Var)} | set(captures), joint.reads, stop=set())
    body = [b for b in bindings if b.var in needed]
    fields = outs + captures
    result = relax.Var("forward_result", relax.TupleType([v.ty for v in fields]))
    body.append(relax.VarBinding(result, relax.Tuple(fields)))
    return rebuild(adj, params, body, result, attrs={"global_symbol": names.FORWARD})


def _backward_function(
    adj: relax.Function, grad: GradientResult, joint: JointGraph, primal_params: list[relax.Var], part: _BackwardPart
) -> tuple[relax.Function, list[int]]:
    """Backward params: captured values, primal params read, output grads."""
    body = [b for b in adj.body.blocks[0].bindings if b.var in part.adjoint or b.var in part.recompute]
    reads: set[relax.Var] = set()
    for b in body:
        reads.update(joint.reads[b.var])
    param_idx = [i for i, p in enumerate(primal_params) if p in reads]
    cap_params = [relax.Var(f"{names.SAVED}{v.name}", v.ty) for v in part.captures]
    bindings: list[relax.Binding] = [relax.VarBinding(v, p) for v, p in zip(part.captures, cap_params)]
    bindings += body
    unresolved = reads - ({b.var for b in body} | set(part.captures) | set(adj.params))
    if unresolved:
        raise ConversionError(
            "split", f"backward reads values neither captured nor recomputed: {sorted(v.name for v in unresolved)}"
        )
    grad_vars = result_grads(adj)
    result = relax.Var("backward_result", relax.TupleType([g.ty for g in grad_vars]))
    bindings.append(relax.VarBinding(result, relax.Tuple(grad_vars)))
    params = cap_params + [primal_params[i] for i in param_idx] + list(grad.grad_out_params)
    symbols = size_symbols(primal_params)
    if symbols:  # the call's sizes: a backward whose captures carry only products (s0*s1) can compute them
        params.append(relax.Var(names.SIZES, relax.ShapeType(symbols)))
    return rebuild(adj, params, bindings, result, attrs={"global_symbol": names.BACKWARD}), param_idx


def size_symbols(params: list[relax.Var]) -> list:
    """Every shape symbol the primal parameters define, in order of first appearance."""
    seen: dict[str, object] = {}
    for p in params:
        for v in relax.analysis.definable_tir_vars_in_type(p.ty):
            seen.setdefault(v.name, v)
    return list(seen.values())
