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


def _make(trans_a: bool, trans_b: bool):
    """``out = op(a) @ op(b)`` with ``op`` a transpose of the last two dims where asked: the
    transpose is a strided view for BLAS, so a ``permute_dims`` feeding a matmul costs nothing."""

    def matmul(a, b, out) -> None:
        ta, tb = torch.from_dlpack(a), torch.from_dlpack(b)
        torch.matmul(ta.mT if trans_a else ta, tb.mT if trans_b else tb, out=torch.from_dlpack(out))

    return matmul


def func_name(trans_a: bool, trans_b: bool) -> str:
    return f"{MATMUL_FUNC}_{'t' if trans_a else 'n'}{'t' if trans_b else 'n'}"


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        for ta in (False, True):
            for tb in (False, True):
                tvm_ffi.register_global_func(func_name(ta, tb), _make(ta, tb), override=True)
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


def offload_matmuls(mod: tvm.IRModule) -> tvm.IRModule:
    """Replace every static-shape float32/float64 ``R.matmul`` with the torch matmul call."""
    register()
    mod = rewrite_module(relax.transform.Normalize()(mod), [_offload])
    return relax.transform.DeadCodeElimination()(mod)
