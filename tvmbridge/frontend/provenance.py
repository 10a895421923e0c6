"""Where a traced aten node came from: the node of the program as it was handed to the trace.

``torch.export`` records each node's provenance (``meta["from_node"]``, a chain through every
retrace and decomposition). Its root names the node of the graph the trace ran: for a dynamo
graph, the node dynamo captured. A conversion failure that names those nodes tells the
``torch.compile`` backend where to cut the graph so that PyTorch runs just them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def origin(node: torch.fx.Node) -> str | None:
    """The name of the node ``node`` was traced from (the root of its provenance), if recorded."""
    sources = node.meta.get("from_node")
    root = None
    while sources:
        root = sources[0]
        sources = root.from_node
    return None if root is None else root.name


def origins(nodes: Iterable[torch.fx.Node]) -> tuple[str, ...]:
    """The distinct origins of ``nodes``, in their order (nodes without one left out)."""
    return tuple(dict.fromkeys(name for n in nodes if (name := origin(n)) is not None))
