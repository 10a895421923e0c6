"""Small helpers for rebuilding a single-dataflow-block Relax function."""
from __future__ import annotations

from tvm import relax


def only_dataflow_block(func: relax.Function, stage: str) -> relax.DataflowBlock:
    """The bridge works on functions of one dataflow block (what the frontend makes for a pure
    module). Anything else is named, not half-handled."""
    from ..errors import ConversionError

    body = func.body
    if not isinstance(body, relax.SeqExpr) or len(body.blocks) != 1 or not isinstance(
        body.blocks[0], relax.DataflowBlock
    ):
        raise ConversionError(
            stage, "expected a function with exactly one dataflow block (a pure module without "
            "control flow or side effects)"
        )
    return body.blocks[0]


def rebuild(
    func: relax.Function,
    params: list[relax.Var],
    bindings: list[relax.Binding],
    result: relax.Expr,
    attrs: dict | None = None,
) -> relax.Function:
    """A new function with the given params and dataflow bindings, normalized."""
    import tvm

    body = relax.SeqExpr([relax.DataflowBlock(bindings)], result)
    new = relax.Function(params, body, ret_ty=result.ty, is_pure=True)
    merged = dict(func.attrs) if func.attrs is not None else {}
    merged.update(attrs or {})
    for k, v in merged.items():
        new = new.with_attr(k, v)
    return relax.transform.Normalize()(tvm.IRModule({"f": new}))["f"]


def binding_map(block: relax.DataflowBlock) -> dict[relax.Var, relax.Expr]:
    return {b.var: b.value for b in block.bindings}
