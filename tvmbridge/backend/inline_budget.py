"""How large a kernel's expressions grow when its blocks are inlined, and which blocks must stay
blocks so that they do not grow past a budget.

Inlining copies a producer's expression into its consumer once per load of it. A chain of blocks
each reading the one before more than once doubles at every link: Swin's shifted-window mask,
built by nine slice assignments (each a concatenation choosing between two reads of the last) and
then compared with itself, fused into the attention's add, took ``compute_inline`` minutes per
block by the sixtieth and would have taken LLVM longer. A block whose inlined expression would
pass the budget is computed once into its buffer and read by loads instead (what it is before
scheduling): the same values, a small buffer, a compile in seconds.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import Expr, TensorLoad

#: expression nodes an inlined block may reach; an injective block is tens of nodes on its own,
#: so only chains that multiply come near it
MAX_INLINED_NODES = 2000


def _size_and_loads(stmt: s_tir.SBlock) -> tuple[int, dict[tirx.Buffer, int]]:
    """The number of expression nodes in ``stmt``'s body and how many loads it makes of each
    buffer (a load counted with its indices, not its buffer's shape)."""
    nodes = 0
    loads: dict[tirx.Buffer, int] = {}

    def load(expr: Expr, visitor: tvm_ffi.StructuralVisitor) -> None:
        nonlocal nodes
        nodes += 1
        loads[expr.source] = loads.get(expr.source, 0) + 1
        for index in expr.indices:
            visitor.visit(index)

    def other(expr: Expr, visitor: tvm_ffi.StructuralVisitor) -> None:
        nonlocal nodes
        nodes += 1
        visitor.default_visit(expr)

    tvm_ffi.structural_visit(stmt.body, [(TensorLoad, load), (Expr, other)])
    return nodes, loads


def kept_as_blocks(sch: s_tir.Schedule, blocks: list, outputs: set[str], limit: int = MAX_INLINED_NODES) -> set[str]:
    """The names of the blocks among ``blocks`` (in program order, each block's producers before
    it) not to inline: those whose expression, with every producer not kept inlined into it,
    would pass ``limit`` nodes. A kept block counts as one load in its readers. ``outputs`` are
    never inlined and never kept (they are the kernel's loop nests)."""
    inlined_size: dict[tirx.Buffer, int] = {}  # a block's written buffer -> its size once inlined
    kept: set[str] = set()
    for block in blocks:
        stmt = sch.get(block)
        own, loads = _size_and_loads(stmt)
        size = own + sum(n * (inlined_size.get(buf, 1) - 1) for buf, n in loads.items())
        if stmt.name_hint not in outputs and size > limit:
            kept.add(stmt.name_hint)
            size = 1
        for write in stmt.writes:
            inlined_size[write.source] = size
    return kept
