"""Keep TVM's ``FuseOps`` linear on long graphs: mark beforehand the values it would refuse to fuse.

``FuseOps`` tries to fuse each value into its immediate post-dominator, but first counts every node
between the two (``GraphPartitioner::CountNodesUptoSink_``, a fresh hash set per value) and refuses
when the count passes its depth limit (``relax.FuseOps.max_depth``, 256). A value whose consumers
are far apart (an unrolled recurrence's state read by the next step and by a late concatenation, a
backward graph's saved activations) has a post-dominator thousands of nodes away: the count walks
them all, for each such value and in each of its three phases, quadratic in the graph's length.

:func:`bound_fusion_search` finds those values first, with the same post-dominator tree
``FuseOps`` builds (its ``DominatorTree::PostDom``: the least common ancestor of a value's
consumers; none for a block output) and the same count cut off at the limit, and gives each one
more consumer: an unused block output ``v_far = v``. A value read by a block output has no
post-dominator to ``FuseOps``, which then skips it before counting. The fusion is the same: the
marked value could not fuse anyway, and a value whose post-dominator lay beyond it could not
either (its count covers the marked value's). The aliases are dead code, removed by the
``DeadCodeElimination`` after ``FuseTIR``.
"""

from __future__ import annotations

import tvm
from tvm import relax

DEFAULT_MAX_DEPTH = 256  # FuseOps' kMaxFusedOps
ALIAS_SUFFIX = "_far"


def _max_depth() -> int:
    value = tvm.transform.PassContext.current().config.get("relax.FuseOps.max_depth")
    return int(value) if value is not None else DEFAULT_MAX_DEPTH


def _consumers(block: relax.DataflowBlock, bindings: list[relax.Binding]) -> list[list[int]]:
    """Each binding's consumers, as indices into ``bindings``: the edges of FuseOps' graph
    (which gives a ``match_cast`` no incoming edge)."""
    index = {b.var: i for i, b in enumerate(bindings)}
    match = {i for i, b in enumerate(bindings) if isinstance(b, relax.MatchCast)}
    users: list[list[int]] = [[] for _ in bindings]
    for var, uses in relax.analysis.udchain(block).items():
        if (i := index.get(var)) is not None:
            users[i] = [j for u in uses if (j := index.get(u)) is not None and j not in match]
    return users


def _post_dominators(users: list[list[int]], external: list[bool]) -> list[int | None]:
    """The immediate post-dominator of each binding as FuseOps computes it: none for a block
    output or an unused value, else the least common ancestor of its consumers in the tree."""
    n = len(users)
    parent: list[int | None] = [None] * n
    depth = [1] * n
    for i in range(n - 1, -1, -1):
        if external[i] or not users[i]:
            continue
        p: int | None = users[i][0]
        for q in users[i][1:]:
            a: int | None = p
            b: int | None = q
            while a != b and a is not None and b is not None:
                if depth[a] < depth[b]:
                    b = parent[b]
                elif depth[b] < depth[a]:
                    a = parent[a]
                else:
                    a, b = parent[a], parent[b]
            p = a if a == b else None
            if p is None:
                break
        parent[i] = p
        depth[i] = depth[p] + 1 if p is not None else 1
    return parent


def _reaches(users: list[list[int]], start: int, sink: int, limit: int) -> bool:
    """Whether at least ``limit`` nodes lie between ``start`` (counted) and ``sink`` (not)."""
    seen = {start}
    stack = [start]
    while stack and len(seen) < limit:
        for u in users[stack.pop()]:
            if u != sink and u not in seen:
                seen.add(u)
                stack.append(u)
    return len(seen) >= limit


def unfusable_far(block: relax.DataflowBlock, limit: int = DEFAULT_MAX_DEPTH) -> list[int]:
    """Indices of the bindings whose post-dominator is at least ``limit`` nodes away. The nodes
    between a value and its post-dominator come between them in binding order, so only values
    ``limit`` or more bindings before it are counted."""
    bindings = list(block.bindings)
    users = _consumers(block, bindings)
    external = [not isinstance(b.var, relax.DataflowVar) for b in bindings]
    parent = _post_dominators(users, external)
    return [i for i, p in enumerate(parent) if p is not None and p - i >= limit and _reaches(users, i, p, limit)]


def _fused_by_fuse_ops(func: relax.BaseFunc) -> bool:
    """The functions FuseOps partitions: Relax functions not already fused or offloaded."""
    if not isinstance(func, relax.Function):
        return False
    attrs = func.attrs or {}
    return not (attrs.get("Primitive") or attrs.get("Codegen"))


def _single_block(func: relax.Function) -> relax.DataflowBlock | None:
    body = func.body
    if isinstance(body, relax.SeqExpr) and len(body.blocks) == 1 and isinstance(body.blocks[0], relax.DataflowBlock):
        return body.blocks[0]
    return None


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.BoundFusionSearch")
def bound_fusion_search(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Before ``FuseOps``: each value it would refuse for distance read by an unused block output."""
    limit = _max_depth()
    out = mod
    for gv, func in mod.functions_items():
        if not _fused_by_fuse_ops(func) or (block := _single_block(func)) is None or len(block.bindings) <= limit:
            continue
        far = set(unfusable_far(block, limit))
        if not far:
            continue
        bindings: list[relax.Binding] = []
        for i, b in enumerate(block.bindings):
            bindings.append(b)
            if i in far:
                bindings.append(relax.VarBinding(relax.Var(b.var.name + ALIAS_SUFFIX, b.var.ty), b.var))
        body = relax.SeqExpr([relax.DataflowBlock(bindings)], func.body.body)
        if out is mod:
            out = mod.clone()
        out[gv] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    return out
