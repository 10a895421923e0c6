"""Which GEMM library runs each matmul, chosen by measuring on the machine it runs on.

A rule fitted on one CPU (oneDNN's inner product beat MKL on AMD Zen) was wrong on another (2x
slower on an Intel Xeon for some layouts). So for each distinct GEMM (dtype, operand shapes,
transposes, thread count) every library that can run it is timed once, at compile time, on
operands of that shape, and the fastest is kept: the result can never be slower than the best
single library on that machine (up to timing noise), as inductor's max-autotune GEMM selection.

The choices are cached on disk (``gemm_choices.json`` in :func:`cache_dir`), keyed by the
machine: CPU model, ISA flags, torch threads and torch/oneDNN/TVM versions, so a second compile
measures nothing and a changed machine or library measures again. A cache file that cannot be
read is a warning and a fresh measurement, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..disk_cache import cache_dir
from ..kernels.gemm import library_call, onednn_available, onednn_fits
from ..options import GEMM_BACKENDS

FORMAT = 1
_ISA_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


def machine() -> dict[str, Any]:
    """What a GEMM's speed depends on besides its shape."""
    import tvm

    model, flags = "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    return {
        "cpu": model,
        "isa": sorted(f for f in _ISA_FLAGS if f in flags),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "tvm": tvm.__version__,
        "onednn": onednn,
        "matmul_precision": torch.get_float32_matmul_precision(),
    }


@dataclass(frozen=True)
class GemmProblem:
    """One GEMM as stored: operand shapes before the transposes the library applies."""

    dtype: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    trans_a: bool
    trans_b: bool

    @property
    def key(self) -> str:
        flags = f"{'t' if self.trans_a else 'n'}{'t' if self.trans_b else 'n'}"
        return f"{self.dtype} {flags} {'x'.join(map(str, self.a_shape))} @ {'x'.join(map(str, self.b_shape))}"

    @property
    def flops(self) -> int:
        m, k = (self.a_shape[-1], self.a_shape[-2]) if self.trans_a else (self.a_shape[-2], self.a_shape[-1])
        n = self.b_shape[-2] if self.trans_b else self.b_shape[-1]
        batch = 1
        for d in self.a_shape[:-2]:
            batch *= d
        return 2 * batch * m * k * n

    def candidates(self) -> list[str]:
        """The libraries that can run it here (``torch`` always)."""
        fits = onednn_fits(self.dtype, self.a_shape, self.b_shape, self.trans_a)
        return ["torch", "onednn"] if fits and onednn_available() else ["torch"]


@dataclass(frozen=True)
class GemmDecision:
    """The library a GEMM runs on, and why (``measured``, ``cached``, ``only candidate``, or the
    fixed backend's name); ``seconds``: each candidate's time where measured."""

    problem: GemmProblem
    library: str
    reason: str
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def gflops(self) -> float | None:
        t = self.seconds.get(self.library)
        return self.problem.flops / t / 1e9 if t else None


def time_gemms(problem: GemmProblem, libraries: list[str], budget_s: float = 0.1, rounds: int = 7) -> dict[str, float]:
    """Seconds of one call per library: the fastest of up to ``rounds`` rounds after a warm-up
    round (oneDNN's primitive creation, page faults), each round calling every library once, so
    that a burst of load from elsewhere on the machine slows all candidates alike instead of
    deciding the choice. At least 3 rounds, more while ``budget_s`` lasts; but one where the
    warm-up round alone took the budget (a language model's vocabulary GEMMs, a quarter second a
    call, where three rounds cost seconds of every first compile on a machine): a call that long
    averages the machine's noise over itself, and libraries that one timing cannot tell apart are
    close enough that either choice costs little."""
    dtype = getattr(torch, problem.dtype)
    a = torch.full(problem.a_shape, 0.5, dtype=dtype)  # a GEMM's speed does not depend on the values
    b = torch.full(problem.b_shape, 0.5, dtype=dtype)
    a, b = (a.mT if problem.trans_a else a), (b.mT if problem.trans_b else b)
    calls = {lib: library_call(lib) for lib in libraries}

    def one_round() -> dict[str, float]:
        seconds = {}
        for lib, call in calls.items():
            t = time.perf_counter()
            call(a, b, None)
            seconds[lib] = time.perf_counter() - t
        return seconds

    long_calls = sum(one_round().values()) >= budget_s
    best = {lib: float("inf") for lib in libraries}
    spent, done = 0.0, 0
    while done < rounds and (done < (1 if long_calls else 3) or spent < budget_s):
        for lib, dt in one_round().items():
            best[lib] = min(best[lib], dt)
            spent += dt
        done += 1
    return best


class ChoiceCache:
    """The measured choices of one machine, in a JSON file shared by every machine key."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_dir() / "gemm_choices.json"
        self.machine = machine()
        self.machine_key = hashlib.sha256(json.dumps(self.machine, sort_keys=True).encode()).hexdigest()[:16]
        self._lock = threading.Lock()
        self._choices: dict[str, dict] = self._load().get(self.machine_key, {}).get("choices", {})

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"tvmbridge: ignoring the unreadable GEMM choice cache {self.path} ({exc}); measuring again",
                stacklevel=3,
            )
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("machines"), dict):
            warnings.warn(
                f"tvmbridge: ignoring the GEMM choice cache {self.path} (not format {FORMAT}); measuring again",
                stacklevel=3,
            )
            return {}
        return data["machines"]

    def get(self, problem: GemmProblem) -> dict | None:
        entry = self._choices.get(problem.key)
        return entry if isinstance(entry, dict) and entry.get("library") in problem.candidates() else None

    def put(self, decision: GemmDecision) -> None:
        with self._lock:
            self._choices[decision.problem.key] = {"library": decision.library, "seconds": decision.seconds}
            self._save()

    def _save(self) -> None:
        """Merge into the file (other machines' and processes' entries kept), written atomically."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            machines = self._load_quiet()
            mine = machines.setdefault(self.machine_key, {"machine": self.machine, "choices": {}})
            mine["choices"] = {**mine.get("choices", {}), **self._choices}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".gemm_choices.")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "machines": machines}, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as exc:  # a read-only home: the choices still hold for this process
            warnings.warn(f"tvmbridge: could not write the GEMM choice cache {self.path}: {exc}", stacklevel=3)

    def _load_quiet(self) -> dict:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._load()


class GemmChooser:
    """Picks each GEMM's library under ``backend``: ``"auto"`` measures (through ``cache``), a
    library name fixes it where it fits. The one impure step of the offload: the plan and the
    pass (``offload``) only read what it chose."""

    def __init__(
        self,
        backend: str,
        cache: ChoiceCache | None = None,
        timer: Callable[[GemmProblem, list[str]], dict[str, float]] | None = None,
    ) -> None:
        if backend not in GEMM_BACKENDS:
            raise ValueError(f"unknown matmul backend {backend!r}; expected one of {GEMM_BACKENDS}")
        self.backend = backend
        self.cache = cache
        self.timer = timer

    def choose(self, problem: GemmProblem) -> GemmDecision:
        candidates = problem.candidates()
        if self.backend != "auto":
            if self.backend == "onednn" and not onednn_available():
                raise RuntimeError(
                    "offload_matmul='onednn': PyTorch's oneDNN (torch.ops.mkldnn."
                    "_linear_pointwise) is not available or disabled in this torch build"
                )
            library = self.backend if self.backend in candidates else "torch"
            return GemmDecision(problem, library, f"offload_matmul={self.backend!r}")
        if len(candidates) == 1:
            return GemmDecision(problem, candidates[0], "only candidate")
        cached = self.cache.get(problem) if self.cache is not None else None
        if cached is not None:
            return GemmDecision(problem, cached["library"], "cached", dict(cached.get("seconds", {})))
        seconds = (self.timer or time_gemms)(problem, candidates)
        decision = GemmDecision(problem, min(seconds, key=seconds.__getitem__), "measured", seconds)
        if self.cache is not None:
            self.cache.put(decision)
        return decision

    def choose_all(self, problems: list[GemmProblem]) -> dict[GemmProblem, GemmDecision]:
        """A decision for each distinct problem, asked in order (``offload.plan_offload``'s input)."""
        return {p: self.choose(p) for p in dict.fromkeys(problems)}


def summary(decisions: list[GemmDecision]) -> str:
    """One line: how many GEMMs went where and how they were chosen."""
    if not decisions:
        return "no offloaded GEMMs"
    counts = {lib: sum(d.library == lib for d in decisions) for lib in sorted({d.library for d in decisions})}
    reasons = sorted({d.reason for d in decisions})
    return ", ".join(f"{n} on {lib}" for lib, n in counts.items()) + f" ({', '.join(reasons)})"
