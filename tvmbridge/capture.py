"""Which forward values the backward keeps (captures) and which it recomputes.

A policy is a function ``JointGraph -> list of primal value names``; ``split`` carries it out.
``"all"`` keeps every tensor the backward reads (the 2020 experiment's choice). The
memory-informed default comes with the capture-set issue and plugs in here.
"""
from __future__ import annotations

from typing import Callable

from .split import JointGraph

CapturePolicy = Callable[[JointGraph], list[str]]


def capture_all(joint: JointGraph) -> list[str]:
    """Every tensor-valued primal value the backward reads, in binding order."""
    reads = joint.backward_reads()
    return [n for n, node in joint.nodes.items() if n in reads and node.shape is not None]


POLICIES: dict[str, CapturePolicy] = {"all": capture_all}


def choose_captures(joint: JointGraph, policy: str | CapturePolicy = "all") -> list[str]:
    if callable(policy):
        return list(policy(joint))
    try:
        return POLICIES[policy](joint)
    except KeyError:
        raise ValueError(f"unknown capture policy {policy!r}; choose one of {sorted(POLICIES)}") from None
