"""Offload dense matmuls to the GEMM libraries PyTorch already ships, through ``R.call_pure_packed``.

Untuned TVM matmuls on CPU are naive loops (a BertLayer step ~40x slower than eager). This is the
pattern TVM itself uses for cuBLAS/CUTLASS: the Relax matmul becomes a call of a registered packed
function that runs the library on zero-copy DLPack views of TVM's tensors and hands its result
back the same way (returning the library's own output measured 2% faster at (8,128) and 18% at
(1,14) than copying it into a TVM-planned buffer). Transposes feeding a matmul fold into flags,
and a bias add into the call. Everything around the matmuls stays in TVM and is fused there.

Backends, chosen per matmul at compile time (``backend=``):

* ``"torch"``: ``torch.matmul``/``torch.addmm``. On x86 that is MKL's sgemm, which on non-Intel
  CPUs takes its AVX2 path even where AVX-512 is there.
* ``"onednn"``: PyTorch's bundled oneDNN inner product (``torch.ops.mkldnn._linear_pointwise``,
  the kernel inductor's CPU freezing path calls), which dispatches on the CPU's ISA. It runs the
  BertLayer GEMMs at 260-390 GFLOP/s against MKL's 150-180 on an AMD EPYC Zen 5 VM, and at
  150-210 against 135-190 on a Zen 4 (``scripts/bench_train.py --gemm-table``). Float32 only,
  and only where the right operand is 2-D (weight-like); batched matmuls (attention's) stay on
  ``torch``.
* ``"auto"`` (the default): oneDNN where it applies and a start-up probe found it working and
  agreeing with ``torch.mm``; ``torch`` elsewhere.

Both are IEEE float32 GEMMs whose results differ by summation order only, unless the user lowered
``torch.backends.mkldnn.matmul``'s precision, which then holds for eager PyTorch as well.
"""
from __future__ import annotations

from typing import Callable

import torch
import tvm
import tvm_ffi
from tvm import relax

from ._rewrite import is_op, rewrite_module, static_shape

BACKENDS = ("auto", "torch", "onednn")
_REGISTERED = False
_ONEDNN_OK: bool | None = None


def _gemm(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``(a, b, bias) -> a @ b (+ bias)`` on one library, operands already transposed views."""
    if backend == "onednn":
        linear = torch.ops.mkldnn._linear_pointwise
        # linear(x, w, bias) = x @ w.T + bias: the right operand goes in as a view ``b.mT``,
        # which oneDNN reads in either layout.
        return lambda a, b, bias: linear(a, b.mT, bias, "none", [], "")
    return lambda a, b, bias: torch.matmul(a, b) if bias is None else torch.addmm(bias, a, b)


def _make(trans_a: bool, trans_b: bool, bias: bool, backend: str):
    """The packed function ``op(a) @ op(b) (+ bias)``, ``op`` a transpose of the last two dims
    where asked: a strided view for the library, so a ``permute_dims`` feeding a matmul costs
    nothing, and the bias add rides along in the GEMM's epilogue (like nn.Linear)."""
    gemm = _gemm(backend)
    to_torch = torch.from_dlpack

    def from_torch(y: torch.Tensor):  # TVM's kernels read compact row-major tensors
        return tvm_ffi.from_dlpack(y if y.is_contiguous() else y.contiguous())

    if bias:
        def addmm(a, b, c):
            ta, tb = to_torch(a), to_torch(b)
            return from_torch(gemm(ta.mT if trans_a else ta, tb.mT if trans_b else tb, to_torch(c)))
        return addmm

    def matmul(a, b):
        ta, tb = to_torch(a), to_torch(b)
        return from_torch(gemm(ta.mT if trans_a else ta, tb.mT if trans_b else tb, None))

    return matmul


def onednn_available() -> bool:
    """Whether PyTorch's oneDNN inner product is there, enabled and agrees with ``torch.mm`` on a
    probe (checked once; it is an internal op, so a torch build without it or with a changed
    schema falls back to ``torch`` instead of failing at run time)."""
    global _ONEDNN_OK
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    if _ONEDNN_OK is None:
        try:
            g = torch.Generator().manual_seed(0)
            x, w = torch.randn(5, 7, generator=g), torch.randn(3, 7, generator=g)
            bias = torch.randn(3, generator=g)
            y = _gemm("onednn")(x.mT.contiguous().mT, w.mT, bias)
            _ONEDNN_OK = bool(torch.allclose(y, torch.addmm(bias, x, w.mT), rtol=1e-5, atol=1e-5))
        except Exception:  # noqa: BLE001 - any failure means: do not use it
            _ONEDNN_OK = False
    return _ONEDNN_OK


def func_name(trans_a: bool, trans_b: bool, bias: bool = False, backend: str = "torch") -> str:
    kind = "addmm" if bias else "matmul"
    return f"tvmbridge.{backend}_{kind}_{'t' if trans_a else 'n'}{'t' if trans_b else 'n'}"


def _parse(call: relax.Expr) -> tuple[str, str, bool, bool] | None:
    """``(backend, kind, trans_a, trans_b)`` of a call of one of our functions, else None."""
    if not isinstance(call, relax.Call) or not is_op(call, "relax.call_pure_packed"):
        return None
    name = str(call.args[0].global_symbol)
    if not name.startswith("tvmbridge."):
        return None
    backend, kind, flags = name[len("tvmbridge."):].split("_")
    return backend, kind, flags[0] == "t", flags[1] == "t"


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        for backend in ("torch", "onednn"):
            for ta in (False, True):
                for tb in (False, True):
                    for bias in (False, True):
                        tvm_ffi.register_global_func(
                            func_name(ta, tb, bias, backend), _make(ta, tb, bias, backend), override=True
                        )
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


def _pick_backend(backend: str, dtype: str, a_shape: tuple, b_shape: tuple, trans_a: bool) -> str:
    """oneDNN where it applies: float32, a 2-D right operand, and a left operand it can read as
    rows of ``k`` without a gather (2-D, or N-D untransposed)."""
    if backend == "torch":
        return "torch"
    fits = dtype == "float32" and len(b_shape) == 2 and (len(a_shape) == 2 or not trans_a)
    if backend == "onednn":
        if not onednn_available():
            raise RuntimeError("offload_matmul='onednn': PyTorch's oneDNN (torch.ops.mkldnn."
                               "_linear_pointwise) is not available or disabled in this torch build")
        return "onednn" if fits else "torch"
    return "onednn" if fits and onednn_available() else "torch"


def _offload(backend: str):
    def rule(value: relax.Expr, bound: dict) -> relax.Expr | None:
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
        chosen = _pick_backend(backend, dtype, static_shape(a), static_shape(b), ta)
        return relax.op.call_pure_packed(
            func_name(ta, tb, False, chosen), a, b, ty_args=relax.TensorType(out_shape, dtype)
        )

    return rule


def _bias_add(uses: dict[relax.Var, int]):
    """``add(bias, mm)`` over a 2-D offloaded matmul used only there, with a 1-D bias of the
    output's last dim: one ``addmm``."""

    def rule(value: relax.Expr, bound: dict) -> relax.Expr | None:
        if not is_op(value, "relax.add") or getattr(value, "ty", None) is None:
            return None
        for mm, bias in (value.args, reversed(value.args)):
            call = bound.get(mm) if isinstance(mm, relax.Var) else None
            parsed = _parse(call)
            if parsed is not None and parsed[1] == "matmul" and uses.get(mm, 0) == 1:
                out = static_shape(value)
                bshape = static_shape(bias)
                if out is None or len(out) != 2 or bshape != (out[1],) or static_shape(mm) != out:
                    continue
                if str(bias.ty.dtype) != str(value.ty.dtype):
                    continue
                backend, _, ta, tb = parsed
                a, b = call.args[1], call.args[2]
                return relax.op.call_pure_packed(
                    func_name(ta, tb, True, backend), a, b, bias,
                    ty_args=relax.TensorType(out, str(value.ty.dtype)),
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


def offload_matmuls(mod: tvm.IRModule, backend: str = "auto") -> tvm.IRModule:
    """Replace every static-shape float32/float64 ``R.matmul`` with a call of a GEMM library
    (``backend``: see the module docstring), and fold a following bias add into ``addmm``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown matmul backend {backend!r}; expected one of {BACKENDS}")
    register()
    mod = relax.transform.Normalize()(mod)
    mod = rewrite_module(mod, [_offload(backend), _bias_add(_use_counts(mod))])
    return relax.transform.DeadCodeElimination()(mod)


def offloaded_gemms(func: relax.Function) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Every offloaded call in ``func`` as ``(function name, operand shapes)``, in program order:
    what ``scripts/bench_train.py --gemm-table`` times on each backend."""
    return [
        (str(b.value.args[0].global_symbol), [static_shape(x) for x in b.value.args[1:]])
        for block in func.body.blocks for b in block.bindings if _parse(b.value) is not None
    ]
