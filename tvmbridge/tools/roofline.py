"""The machine's limit, measured, and each benchmark figure as a fraction of it.

A ratio to eager says whether the bridge beats PyTorch, not how far either is from what the
machine can do. So benchmarks print each step's FLOPs (the analysis package's counter, forward
and backward, on the eager model) and the step's rate as a fraction of the peak GEMM rate of its
dtype, measured here by a short GEMM probe with each library a step may call (``torch.mm``,
oneDNN): the best sustained rate this process can get, on this CPU's ISA (AVX2, AVX-512,
AVX512-BF16, AMX; named in the line). A CPU without native bfloat16 has a bfloat16 "peak" below its float32 one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

_ISA_NAMES = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


@dataclass(frozen=True)
class Peak:
    """The best GEMM rate of one dtype on this machine."""

    dtype: str
    gflops: float
    library: str  # the fastest of the probes: ``torch.mm`` or ``oneDNN``
    probe: str  # what was timed

    def fraction(self, flops: float, seconds: float) -> float:
        return flops / seconds / 1e9 / self.gflops


def isa() -> str:
    """The widest matrix/vector ISA the CPU reports (``/proc/cpuinfo`` flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown ISA"
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith(("flags", "Features"))), [])
    return ", ".join(name for flag, name in _ISA_NAMES if flag in flags) or "no AVX2"


def _best_seconds(call: Callable[[], object], seconds: float) -> tuple[float, int]:
    """The fastest of repeated calls of ``call`` (after a warm-up), and how many were timed."""
    call()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < seconds:
        t = time.perf_counter()
        call()
        dt = time.perf_counter() - t
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return best, calls


def _gemm_probes(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The GEMM libraries a step of this process may run: ``torch.mm`` (what eager calls: MKL for
    float32 on x86) and oneDNN's inner product where the bridge's GEMMs may go (on some CPUs
    several times MKL's float32 rate: a peak from ``torch.mm`` alone would rank steps above it)."""
    from ..kernels.gemm import library_call, onednn_available, onednn_fits

    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    probes: dict[str, Callable[[], object]] = {"torch.mm": lambda: torch.mm(a, b, out=out)}
    dtype = str(a.dtype).removeprefix("torch.")
    if onednn_available() and onednn_fits(dtype, tuple(a.shape), tuple(b.shape), False):
        onednn = library_call("onednn")
        probes["oneDNN"] = lambda: onednn(a, b, None)
    return probes


@functools.cache
def measure_peak(dtype: torch.dtype = torch.float32, size: int = 1536, seconds: float = 0.6) -> Peak:
    """The fastest ``size``-cubed GEMM of the libraries a step may call (:func:`_gemm_probes`),
    in GFLOP/s, with the torch threads the process has (measured once per process and dtype)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(dtype)
    b = torch.randn(size, size, generator=gen).to(dtype)
    timed = {name: _best_seconds(call, seconds) for name, call in _gemm_probes(a, b).items()}
    name, (best, calls) = min(timed.items(), key=lambda kv: kv[1][0])
    return Peak(str(dtype).removeprefix("torch."), 2 * size**3 / best / 1e9, name, f"{size}^3, best of {calls}")


def peaks(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> dict[str, Peak]:
    return {str(d).removeprefix("torch."): measure_peak(d) for d in dtypes}


def step_flops(step: Callable[[], object]) -> int:
    """FLOPs of one call of ``step`` (forward and backward, as it runs them), by the analysis
    package's counter; run it on the eager model."""
    from analysis.profiling.flops import FlopCounter

    with FlopCounter() as counter:
        step()
    return int(counter.total())


def roofline_header(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> str:
    """One line naming the measured peaks: every benchmark prints it under its machine line."""
    parts = [f"{p.dtype} {p.gflops:.0f} GFLOP/s ({p.library})" for p in peaks(dtypes).values()]
    return f"roofline ({isa()}; {torch.get_num_threads()} threads, fastest GEMM probe): " + ", ".join(parts)


def roofline_cell(flops: float, seconds: float, dtype: torch.dtype = torch.float32) -> str:
    """``GFLOP/s (fraction of the dtype's peak)`` for a step of ``flops`` taking ``seconds``."""
    peak = measure_peak(dtype)
    return f"{flops / seconds / 1e9:.0f} GFLOP/s ({peak.fraction(flops, seconds):.0%} of peak)"
