"""GEMMs from the libraries PyTorch ships, as TVM packed functions on zero-copy DLPack views.

One packed function per :class:`GemmSpec` (library, transpose flags, bias): it reads TVM's tensors
as torch views (a transposed operand is a strided view, so a ``permute_dims`` feeding a matmul
costs nothing), runs the library, and hands its own output back (no copy into a TVM buffer).

Libraries:

* ``"torch"``: ``torch.matmul``/``torch.addmm`` (MKL's sgemm on x86).
* ``"onednn"``: PyTorch's bundled oneDNN inner product (``torch.ops.mkldnn._linear_pointwise``,
  the kernel inductor's CPU freezing path calls), which dispatches on the CPU's ISA. Float32 or
  bfloat16, and only where the right operand is 2-D (weight-like): :func:`onednn_fits`. It is an
  internal op, so :func:`onednn_works` checks it once per dtype against ``torch.addmm``.

Both are IEEE float32 GEMMs whose results differ by summation order only, unless the user lowered
``torch.backends.mkldnn.matmul``'s precision, which then holds for eager PyTorch as well; in
bfloat16 (autocast) both accumulate in float32 and round the result once.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import tvm_ffi

from .. import names

LIBRARIES = ("torch", "onednn")


@dataclass(frozen=True)
class GemmSpec:
    """``op(a) @ op(b) (+ bias)`` on one library, ``op`` a transpose of the last two dims where
    asked. Its :attr:`name` is the packed function's global name; :meth:`parse` reads one back."""

    library: str
    trans_a: bool
    trans_b: bool
    bias: bool = False

    @property
    def kind(self) -> str:
        return f"{'addmm' if self.bias else 'matmul'}_{'t' if self.trans_a else 'n'}{'t' if self.trans_b else 'n'}"

    @property
    def name(self) -> str:
        return f"{names.PACKED_PREFIX}{self.library}_{self.kind}"

    @classmethod
    def parse(cls, name: str) -> GemmSpec | None:
        """The spec whose :attr:`name` is ``name``, else None."""
        return _BY_NAME.get(name)

    def flops(self, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> int:
        """2 * batch * m * k * n for operands of these (stored) shapes."""
        m, k = (a_shape[-1], a_shape[-2]) if self.trans_a else (a_shape[-2], a_shape[-1])
        n = b_shape[-2] if self.trans_b else b_shape[-1]
        return 2 * math.prod(a_shape[:-2]) * m * k * n


ALL_SPECS = [
    GemmSpec(lib, ta, tb, bias) for lib in LIBRARIES for ta, tb, bias in itertools.product((False, True), repeat=3)
]
_BY_NAME = {s.name: s for s in ALL_SPECS}


ONEDNN_DTYPES = ("float32", "bfloat16")


def onednn_fits(dtype: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], trans_a: bool) -> bool:
    """Where oneDNN's inner product applies: float32 or bfloat16 (where :func:`onednn_works` for
    it), a 2-D right operand, a left operand it can read as rows of ``k`` without a gather (2-D,
    or N-D untransposed), and no empty dimension."""
    return (
        dtype in ONEDNN_DTYPES
        and len(b_shape) == 2
        and (len(a_shape) == 2 or not trans_a)
        and 0 not in a_shape
        and 0 not in b_shape
        and (dtype == "float32" or onednn_works(dtype))
    )


def library_call(library: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``(a, b, bias) -> a @ b (+ bias)`` on one library, operands already transposed views.
    Autocast is off inside: the compiled graph fixed the GEMM's dtype (a call made under
    autocast would otherwise turn a float32 GEMM of an autocast-disabled region to bfloat16)."""
    no_autocast = torch._C._DisableAutocast
    if library == "onednn":
        linear = torch.ops.mkldnn._linear_pointwise

        def onednn(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            # linear(x, w, bias) = x @ w.T + bias: the right operand goes in as a view ``b.mT``,
            # which oneDNN reads in either layout.
            with no_autocast():
                return linear(a, b.mT, bias, "none", [], "")

        return onednn

    def torch_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        with no_autocast():
            return torch.matmul(a, b) if bias is None else torch.addmm(bias, a, b)

    return torch_gemm


def to_tvm_compact(y: torch.Tensor) -> Any:
    """A library's result handed back to TVM, whose kernels read compact row-major tensors."""
    return tvm_ffi.from_dlpack(y if y.is_contiguous() else y.contiguous())


def packed_function(spec: GemmSpec) -> Callable[..., Any]:
    """The function TVM calls for ``spec``: DLPack tensors in, a DLPack tensor out."""
    gemm = library_call(spec.library)
    to_torch = torch.from_dlpack

    def operands(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ta, tb = to_torch(a), to_torch(b)
        return (ta.mT if spec.trans_a else ta), (tb.mT if spec.trans_b else tb)

    if spec.bias:

        def addmm(a: Any, b: Any, c: Any) -> Any:
            return to_tvm_compact(gemm(*operands(a, b), to_torch(c)))

        return addmm

    def matmul(a: Any, b: Any) -> Any:
        return to_tvm_compact(gemm(*operands(a, b), None))

    return matmul


@functools.cache
def register_gemms() -> None:
    """Register every packed GEMM with TVM's FFI (once per process)."""
    for spec in ALL_SPECS:
        tvm_ffi.register_global_func(spec.name, packed_function(spec), override=True)


def onednn_available() -> bool:
    """oneDNN is built in, enabled now, and passed :func:`onednn_works`."""
    return torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled) and onednn_works()


@functools.cache
def onednn_works(dtype: str = "float32") -> bool:
    """Whether PyTorch's oneDNN inner product runs in ``dtype`` and agrees with ``torch.addmm``
    on a probe (a torch build without it, a changed schema or a CPU oneDNN has no bfloat16 path
    for keeps ``torch`` instead of failing at run time)."""
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(5, 7, generator=g), torch.randn(3, 7, generator=g)
        bias = torch.randn(3, generator=g)
        x, w, bias = (t.to(getattr(torch, dtype)) for t in (x, w, bias))
        y = library_call("onednn")(x.mT.contiguous().mT, w.mT, bias)
        tol = 1e-5 if dtype == "float32" else 2e-2
        return bool(
            y.dtype == x.dtype and torch.allclose(y.float(), torch.addmm(bias, x, w.mT).float(), rtol=tol, atol=tol)
        )
    except Exception:  # noqa: BLE001 - any failure means: do not use it
        return False
