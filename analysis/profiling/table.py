"""The profile as text: a per-node table (human units) and a one-line summary of a GraphModule
``symbolic_profile`` annotated."""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.node import Node

from analysis.profiling.profile import NodeProfile, ProfileSummary
from analysis.tensors import tensor_leaves
from analysis.units import human_bytes, human_flops

__all__ = ["profile_table", "summary_line"]


def _module_of(node: Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if node.op == "call_module":
        return str(node.target)
    if stack:
        return list(stack.keys())[-1] if not isinstance(stack, list) else str(stack[-1])
    return ""


def _shape_of(node: Node) -> str:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return "x".join(map(str, v.shape)) or "scalar"
    ts = tensor_leaves(v) if isinstance(v, (tuple, list)) else []
    return ",".join("x".join(map(str, t.shape)) for t in ts[:2]) + ("..." if len(ts) > 2 else "")


def profile_table(gm: torch.fx.GraphModule, skip_empty: bool = True) -> str:
    """The per-node table of a profiled GraphModule (human units) and a summary line."""
    head = (
        "node",
        "op",
        "module",
        "shape",
        "output",
        "temp",
        "param",
        "backward",
        "accumulated",
        "incremental",
        "fwd FLOPs",
        "bwd FLOPs",
    )
    rows = [head]
    for n in gm.graph.nodes:
        p: NodeProfile = n.meta["profile"]
        if n.op == "output" or (
            skip_empty
            and n.op != "placeholder"
            and not any((p.output_bytes, p.temp_bytes, p.param_bytes, p.backward_bytes, p.fwd_flops, p.bwd_flops))
        ):
            continue
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        rows.append(
            (
                n.name,
                f"{n.op}:{target}"[:32],
                _module_of(n)[:40],
                _shape_of(n),
                human_bytes(p.output_bytes),
                human_bytes(p.temp_bytes),
                human_bytes(p.param_bytes),
                human_bytes(p.backward_bytes),
                human_bytes(p.accumulated_bytes),
                human_bytes(p.incremental_bytes),
                human_flops(p.fwd_flops),
                human_flops(p.bwd_flops),
            )
        )
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w[i]) if i < 4 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(summary_line(gm))
    return "\n".join(lines)


def summary_line(gm: torch.fx.GraphModule) -> str:
    s: ProfileSummary = gm.meta["profile"]
    return (
        f"total: forward {human_flops(s.fwd_flops)}, backward {human_flops(s.bwd_flops)}; "
        f"peak activation memory {human_bytes(s.peak_activation_bytes)}; "
        f"saved for backward {human_bytes(s.backward_bytes)}; parameters {human_bytes(s.param_bytes)}"
    )
