"""Offload dense matmuls to the BLAS PyTorch already ships, through ``R.call_dps_packed``.

Untuned TVM matmuls on CPU are naive loops (a BertLayer step ~40x slower than eager). This is the
pattern TVM itself uses for cuBLAS/CUTLASS: the Relax call becomes a destination-passing call of
a registered packed function, here ``tvmbridge.torch_matmul``, which runs ``torch.matmul`` on
zero-copy DLPack views of TVM's buffers (``out=`` writes straight into TVM's output). Everything
around the matmuls stays in TVM and is fused there.
"""
from __future__ import annotations

import torch
import tvm
import tvm_ffi
from tvm import relax

from ._rewrite import is_op, rewrite_module, static_shape

MATMUL_FUNC = "tvmbridge.torch_matmul"
_REGISTERED = False


def _make(trans_a: bool, trans_b: bool, bias: bool):
    """``out = op(a) @ op(b) (+ bias)`` with ``op`` a transpose of the last two dims where asked:
    the transpose is a strided view for BLAS, so a ``permute_dims`` feeding a matmul costs
    nothing, and a bias add rides along in ``addmm`` (one pass over the output, like nn.Linear)."""

    if bias:
        def addmm(a, b, c, out) -> None:
            ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
            torch.addmm(torch.from_dlpack(c), ta.mT if trans_a else ta, tb.mT if trans_b else tb,
                        out=torch.from_dlpack(out))
        return addmm

    def matmul(a, b, out) -> None:
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
        torch.matmul(ta.mT if trans_a else ta, tb.mT if trans_b else tb, out=torch.from_dlpack(out))

    return matmul


def func_name(trans_a: bool, trans_b: bool, bias: bool = False) -> str:
    kind = "addmm" if bias else "matmul"
    return f"tvmbridge.torch_{kind}_{'t' if trans_a else 'n'}{'t' if trans_b else 'n'}"


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        for ta in (False, True):
            for tb in (False, True):
                for bias in (False, True):
                    tvm_ffi.register_global_func(func_name(ta, tb, bias), _make(ta, tb, bias), override=True)
        _REGISTERED = True


def _swaps_last_two(value: relax.Expr) -> bool:
    if not is_op(value, "relax.permute_dims"):
        return False
    shape = static_shape(value.args[0])
    if shape is None or len(shape) < 2:
        return False
    n = len(shape)
    axes = [int(a) for a in value.attrs.axes] if value.attrs.axes is not None else list(reversed(range(n)))
    return axes == list(range(n - 2)) + [n - 1, n - 2]


def _operand(expr: relax.Expr, bound: dict) -> tuple[relax.Expr, bool]:
    """The matmul operand with a last-two-dims transpose folded into a flag."""
    value = bound.get(expr) if isinstance(expr, relax.Var) else expr
    if value is not None and _swaps_last_two(value):
        return value.args[0], True
    return expr, False


def _offload(value: relax.Expr, bound: dict) -> relax.Expr | None:
    if not is_op(value, "relax.matmul") or getattr(value, "ty", None) is None:
        return None
    a, b = value.args
    out_shape = static_shape(value)
    if out_shape is None or static_shape(a) is None or static_shape(b) is None:
        return None
    dtype = str(value.ty.dtype)
    if dtype not in ("float32", "float64") or str(a.ty.dtype) != dtype or str(b.ty.dtype) != dtype:
        return None
    if len(static_shape(a)) < 2 or len(static_shape(b)) < 2:
        return None
    (a, ta), (b, tb) = _operand(a, bound), _operand(b, bound)
    return relax.op.call_dps_packed(
        func_name(ta, tb), relax.Tuple([a, b]), relax.TensorType(out_shape, dtype)
    )


def _bias_add(uses: dict[relax.Var, int]):
    """``add(bias, mm)`` over a 2-D offloaded matmul used only there, with a 1-D bias of the
    output's last dim: one ``addmm``."""

    def rule(value: relax.Expr, bound: dict) -> relax.Expr | None:
        if not is_op(value, "relax.add") or getattr(value, "ty", None) is None:
            return None
        for mm, bias in (value.args, reversed(value.args)):
            call = bound.get(mm) if isinstance(mm, relax.Var) else None
            if (
                isinstance(call, relax.Call) and uses.get(mm, 0) == 1
                and str(call.op.name) == "relax.call_dps_packed"
                and str(call.args[0].global_symbol).startswith("tvmbridge.torch_matmul_")
            ):
                out = static_shape(value)
                bshape = static_shape(bias)
                if out is None or len(out) != 2 or bshape != (out[1],) or static_shape(mm) != out:
                    continue
                if str(bias.ty.dtype) != str(value.ty.dtype):
                    continue
                flags = str(call.args[0].global_symbol)[-2:]
                a, b = call.args[1].fields
                return relax.op.call_dps_packed(
                    func_name(flags[0] == "t", flags[1] == "t", True), relax.Tuple([a, b, bias]),
                    relax.TensorType(out, str(value.ty.dtype)),
                )
        return None

    return rule


def _use_counts(mod: tvm.IRModule) -> dict[relax.Var, int]:
    uses: dict[relax.Var, int] = {}
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for block in func.body.blocks:
                for b in block.bindings:
                    for v in relax.analysis.free_vars(b.value):
                        uses[v] = uses.get(v, 0) + 1
            for v in relax.analysis.free_vars(func.body.body):
                uses[v] = uses.get(v, 0) + 1
    return uses


def offload_matmuls(mod: tvm.IRModule) -> tvm.IRModule:
    """Replace every static-shape float32/float64 ``R.matmul`` with the torch matmul call, and
    fold a following bias add into ``addmm``."""
    register()
    mod = relax.transform.Normalize()(mod)
    mod = rewrite_module(mod, [_offload, _bias_add(_use_counts(mod))])
    return relax.transform.DeadCodeElimination()(mod)
