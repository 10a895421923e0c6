"""Which forward values the backward keeps (captures) and which it recomputes.

A policy is a function ``JointGraph -> list of primal value keys``; ``split`` carries it out.

* ``"min-cut"`` (default): the AOTAutograd-style min-cut of ``analysis.memory.partition`` over the joint
  graph, with tensor bytes from Relax types and op cost classes below: only cheap ops (arithmetic,
  layout, broadcasts, reductions that read no more than 4x what they write) may be recomputed;
  transcendental ops (GELU, erf, exp, softmax) only under a memory budget; matmuls, convolutions
  and anything else never. Dropout masks are inputs, so recomputation
  stays exact. ``memory_budget`` (bytes, or a fraction of the save-all bytes) then trades more
  recomputation, cheapest FLOPs per byte first, for fewer bytes.
* ``"all"``: keep every tensor the backward reads (the 2020 experiment's choice).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from analysis.memory.partition import PartitionGraph, PartitionNode, min_cut_with_budget

from ..options import CompileOptions
from .joint import JointGraph, JointNode

CapturePolicy = Callable[[JointGraph], list[str]]

# Cheap to recompute. Transcendental elementwise ops (exp, erf, tanh, GELU, softmax, ...) are
# deliberately absent: cheap in FLOPs but not in time on CPU, recomputing an exact GELU costs as
# much as keeping it saves. They are kept unless a memory budget asks for more (then they are the
# first to be recomputed).
ELEMENTWISE = {
    "relax.add",
    "relax.subtract",
    "relax.multiply",
    "relax.divide",
    "relax.power",
    "relax.negative",
    "relax.sqrt",
    "relax.rsqrt",
    "relax.abs",
    "relax.maximum",
    "relax.minimum",
    "relax.clip",
    "relax.where",
    "relax.astype",
    "relax.nn.relu",
    "relax.square",
    "relax.equal",
    "relax.not_equal",
    "relax.greater",
    "relax.greater_equal",
    "relax.less",
    "relax.less_equal",
    "relax.zeros",
    "relax.ones",
    "relax.full",
    "relax.zeros_like",
    "relax.ones_like",
    "relax.full_like",
}
LAYOUT = {
    "relax.reshape",
    "relax.permute_dims",
    "relax.broadcast_to",
    "relax.expand_dims",
    "relax.squeeze",
    "relax.flatten",
    "relax.strided_slice",
    "relax.concat",
    "relax.split",
    "tuple",
    "getitem",
    "var",
    "const",
}
REDUCTIONS = {"relax.sum", "relax.mean", "relax.variance", "relax.max", "relax.min"}
READ_WRITE_LIMIT = 4  # a recomputed op may read at most this many times the bytes it writes


def op_flops(joint: JointGraph, node: JointNode) -> float:
    """Rough FLOPs (2 per multiply-add) by cost class."""
    if node.op == "relax.matmul":
        a = joint.nodes[node.inputs[0]]
        k = a.shape[-1] if a.shape else 1
        return 2.0 * math.prod(node.shape or ()) * k
    if node.op in REDUCTIONS:
        return float(sum(math.prod(joint.nodes[i].shape or ()) for i in node.inputs))
    if node.op in LAYOUT:
        return 0.0
    return float(math.prod(node.shape or ()))


def recomputable(joint: JointGraph, node: JointNode) -> bool:
    """Cheap ops only: elementwise and layout always, reductions that read at most
    ``READ_WRITE_LIMIT`` times what they write (softmax yes, a LayerNorm mean no)."""
    if node.op in ELEMENTWISE or node.op in LAYOUT:
        return True
    if node.op in REDUCTIONS:
        read = sum(joint.nodes[i].nbytes for i in node.inputs)
        return read <= READ_WRITE_LIMIT * max(node.nbytes, 1)
    return False


def partition_graph(joint: JointGraph) -> PartitionGraph:
    """The primal part of the joint graph in ``analysis.memory.partition``'s terms."""
    nodes: dict[str, PartitionNode] = {}
    for name, node in joint.nodes.items():
        if not node.is_forward:
            continue
        nodes[name] = PartitionNode(
            name=name,
            inputs=[i for i in node.inputs if joint.nodes[i].is_forward],
            nbytes=node.nbytes,
            recomputable=node.is_param or recomputable(joint, node),
            flops=op_flops(joint, node) if not node.is_param else 0.0,
            is_input=node.is_param,
            keepable=node.shape is not None,
        )
    return PartitionGraph(nodes=nodes, backward_reads=joint.backward_reads())


def capture_all(joint: JointGraph) -> list[str]:
    """Every tensor-valued primal value the backward reads, in binding order."""
    reads = joint.backward_reads()
    return [n for n, node in joint.nodes.items() if n in reads and node.shape is not None]


def capture_min_cut(joint: JointGraph, memory_budget: int | float | None = None) -> list[str]:
    """The min-cut policy; ``memory_budget`` in bytes (int) or as a fraction of save-all (float)."""
    budget = memory_budget
    if isinstance(budget, float):  # a fraction, checked by CompileOptions
        budget = int(budget * joint.bytes_of(capture_all(joint)))
    return min_cut_with_budget(partition_graph(joint), budget).saved


def choose_captures(joint: JointGraph, options: CompileOptions) -> list[str]:
    """Run the options' policy: ``"min-cut"``, ``"all"``, or a callable one."""
    policy = options.capture
    if callable(policy):
        return list(policy(joint))
    if policy == "min-cut":
        return capture_min_cut(joint, options.memory_budget)
    return capture_all(joint)
