"""Which of a call's state tensors its other inputs were computed from, before the call.

PyTorch's reference run of a call (the net's check, the differentiable backward) is differentiated
with respect to the call's tensors. A parameter that also made one of the call's inputs, upstream
(an LM head tied to the embedding that made its input; a block applied again to its own output),
is reached along two paths then: the call's own, and back through the input into the graph
before the call. Its gradient then held that earlier graph's share too, which autograd adds
again when it carries the input's gradient on; and that graph was walked, and freed, before
its own backward. Such a tensor is passed to the reference run as an alias of its own: the
alias is reached along the call's own path only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def leaves_upstream(tensors: Sequence[torch.Tensor], leaves: Sequence[torch.Tensor]) -> set[int]:
    """``id`` of each of ``leaves`` (tensors requiring grad) that the autograd graph behind
    ``tensors`` accumulates into: the leaves some of ``tensors`` were computed from."""
    wanted = {id(t): t for t in leaves if t.requires_grad and t.grad_fn is None}
    roots = [t.grad_fn for t in tensors if t.grad_fn is not None]
    if not wanted or not roots:
        return set()
    found: set[int] = set()
    seen: set[int] = set()
    stack = list(roots)
    while stack and len(found) < len(wanted):
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad: the leaf it adds into
        if variable is not None and id(variable) in wanted:
            found.add(id(variable))
        stack.extend(n for n, _ in node.next_functions if n is not None and id(n) not in seen)
    return found
