"""Legalization done once per distinct call: a model's repeated layers legalize alike.

``LegalizeOps`` turns every Relax op into a TE kernel, and TVM builds and lowers each one before
its ``BlockBuilder`` notices that an equal kernel is already in the module. In a training module
(forward, backward and the no-grad forward of every layer) most calls repeat one another, so
``LegalizeOps`` was most of the lowering time. Here a call whose op, attributes, argument types
and pattern of repeated arguments equal an earlier one's gets the earlier result with its own
arguments put in: the same kernel, called on this call's tensors. A result that reads anything
but the call's own arguments and their sizes (a binding or a size the legalization defined on the
side) is never reused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import tvm
import tvm_ffi
from tvm import relax

from ..ir import rewrites_whole, with_vars

Legalization = Callable[[relax.BlockBuilder, relax.Call], relax.Expr]


def _reads_only_its_arguments(call: relax.Call, result: relax.Expr) -> bool:
    """The result reads the call's arguments and their sizes, nothing the legalization defined on
    the side: no variable it emitted, no size a ``match_cast`` of its own gave (a data-dependent
    output shape), which another call with equal types may not share."""
    own = {a for a in call.args if isinstance(a, relax.Var)}
    sizes = {v for a in own for v in relax.analysis.tir_vars_in_type(a.ty)}
    return (
        rewrites_whole(result)
        and all(v in own for v in relax.analysis.free_vars(result))
        and all(v in sizes for v in relax.analysis.free_symbolic_vars(result))
    )


def _signature(call: relax.Call) -> list:
    """What a legalization reads of a call: the op, its attributes and type arguments, each
    argument's type (a non-variable argument itself), and which arguments are the same variable."""
    firsts: dict[relax.Var, int] = {}
    args = []
    for i, a in enumerate(call.args):
        if isinstance(a, relax.Var):
            args.append([a.ty, firsts.setdefault(a, i)])
        else:
            args.append(a)
    return [call.op, call.attrs, list(call.ty_args), args]


class MemoizedLegalization:
    """Legalizations for every op that has one (``fixes`` first, then TVM's ``FLegalize``),
    remembering results for one ``LegalizeOps`` run (a result names kernels of that run's module:
    use a new object per run). ``hits`` and ``misses`` count the calls."""

    def __init__(self, fixes: Mapping[str, Legalization]) -> None:
        self.fixes = fixes
        self.hits = 0
        self.misses = 0
        self._memo: dict[int, list[tuple[list, relax.Call, relax.Expr]]] = {}

    def table(self) -> dict[str, Legalization]:
        """``LegalizeOps``'s custom map: every op with a legalization."""
        names = [n for n in tvm.ir.Op.list_op_names() if n in self.fixes or tvm.ir.Op.get(n).get_attr("FLegalize")]
        return {n: self for n in names}

    def __call__(self, bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        signature = _signature(call)
        key = tvm_ffi.structural_hash(signature)
        for seen, earlier, result in self._memo.get(key, ()):
            if tvm_ffi.structural_equal(seen, signature):
                self.hits += 1
                renamed = {a: b for a, b in zip(earlier.args, call.args) if isinstance(a, relax.Var)}
                return with_vars(result, renamed)
        self.misses += 1
        legalize = self.fixes.get(call.op.name) or call.op.get_attr("FLegalize")
        result = legalize(bb, call)
        if _reads_only_its_arguments(call, result):
            self._memo.setdefault(key, []).append((signature, call, result))
        return result
