"""The options of a compile, in one frozen object with its defaults and its checks.

``add_tvm_dispatch``, ``compile_training``, the command line and the benchmarks all take a
:class:`CompileOptions` (or the same names as keyword overrides), so a default lives here only and
a bad value is refused once, up front, with the valid choices named.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CAPTURE_POLICIES = ("min-cut", "all")
GEMM_BACKENDS = ("auto", "torch", "onednn")


def _doc(text: str) -> dict[str, str]:
    return {"help": text}


# options that change how calls are dispatched or reported, not what is compiled
RUNTIME_ONLY = (
    "fallback",
    "compile_submodules",
    "warn_on_fallback",
    "verify",
    "cache_size_limit",
    "disk_cache",
    "verbose",
    "progress",
)


@dataclass(frozen=True)
class CompileOptions:
    """How a module is compiled and dispatched. Every field has a default; see ``help(field)``
    in :data:`FIELD_HELP` or ``python -m tvmbridge demo --help``."""

    capture: str | Callable[..., list[str]] = field(
        default="min-cut",
        metadata=_doc(
            "what the backward keeps: 'min-cut' (fewest bytes, only cheap ops recomputed) or 'all' "
            "(everything the backward reads); or a callable JointGraph -> capture names"
        ),
    )
    memory_budget: int | float | None = field(
        default=None,
        metadata=_doc(
            "with min-cut: keep at most this many bytes (int) or this fraction of the save-all bytes "
            "(float in (0, 1]); more is recomputed, matmuls included"
        ),
    )
    offload_matmul: bool | str | None = field(
        default=None,
        metadata=_doc(
            "dense matmuls in a GEMM library PyTorch ships: 'auto' (each distinct GEMM timed on every "
            "library that can run it, on this machine, the fastest kept; choices cached in "
            "$TVMBRIDGE_CACHE_DIR or ~/.cache/tvmbridge), 'torch', 'onednn', or False (TVM's own "
            "kernels, for the convolutions too, which otherwise run PyTorch's on a CPU); default: "
            "'auto' on CPU, off elsewhere"
        ),
    )
    fp_contract: bool = field(
        default=False,
        metadata=_doc(
            "let LLVM fuse a multiply and an add into one FMA in TVM's CPU kernels (one rounding where "
            "eager's separate ops round twice): faster compute-bound kernels, results no longer those of "
            "eager's op-by-op rounding, which some networks amplify past noise (timm repvgg's gradients); "
            "off: the CPU target without its FMA feature"
        ),
    )
    fast_math: bool = field(
        default=True,
        metadata=_doc("float32 only: vectorizable erf/exp/tanh (a few ulps from libm); float64 is never touched"),
    )
    cpu_schedules: bool = field(default=True, metadata=_doc("parallel/vectorized schedules for TVM's own CPU kernels"))
    fuse: bool = field(
        default=True, metadata=_doc("operator fusion (FuseOps/FuseTIR); off only to measure what fusion buys")
    )
    mask_kernel: bool = field(
        default=True,
        metadata=_doc(
            "draw large float32 CPU dropout masks with the vectorized MT19937 kernel (same masks as "
            "ATen's bernoulli_); off: ATen's serial bernoulli_"
        ),
    )
    fallback: bool = field(
        default=False, metadata=_doc("on a compile failure warn once and keep PyTorch instead of raising")
    )
    compile_submodules: bool = field(
        default=True,
        metadata=_doc(
            "with fallback: a module that cannot compile as a whole keeps PyTorch for its own code only, "
            "and its submodules with parameters compile by themselves (each checked on its first call); "
            "off: PyTorch runs all of it"
        ),
    )
    warn_on_fallback: bool = field(
        default=True,
        metadata=_doc(
            "warn (tvmbridge.FallbackWarning, once per reason) when a call runs PyTorch because the "
            "compiled code does not fit it"
        ),
    )
    verify: bool = field(
        default=True,
        metadata=_doc(
            "check the first call of every compiled variant against PyTorch on that very call (outputs, "
            "updated buffers, and at its first backward every gradient, same random masks); a mismatch "
            "beyond float noise discards the variant and runs PyTorch for that signature, with a "
            "tvmbridge.VerificationWarning naming the worst tensor. Costs one eager forward and "
            "backward per variant; off only for benchmarks"
        ),
    )
    dynamic: bool | str | dict = field(
        default="auto",
        metadata=_doc(
            "symbolic dimensions: 'auto' (a dimension in which a call differs from a compiled variant "
            "is compiled symbolically, one variant for every size), False (a variant per exact shape), "
            "or {argument: {dim: name}} to compile those dims symbolically from the first compile"
        ),
    )
    cache_size_limit: int = field(
        default=8,
        metadata=_doc(
            "compiled variants kept per module (one per call signature: shapes, dtypes, train/eval, "
            "keywords); a call that would need one more runs PyTorch, with a warning"
        ),
    )
    tuning_db: str | None = field(
        default=None,
        metadata=_doc(
            "a MetaSchedule work directory made by 'tvmbridge tune': its best records replace the default "
            "schedules of the kernels they cover (the rest keep them, said once), and its GEMM choices are used"
        ),
    )
    disk_cache: bool = field(
        default=True,
        metadata=_doc(
            "keep compiled executables and compile results on disk ($TVMBRIDGE_CACHE_DIR or "
            "~/.cache/tvmbridge, under executables/ and compiles/), keyed by everything the compile reads, "
            "so another process with the same model traces it and loads the rest instead of compiling; "
            "TVMBRIDGE_DISK_CACHE=0 also turns it off"
        ),
    )
    converters: tuple[tuple[str, Callable[..., Any]], ...] = field(
        default=(),
        metadata=_doc(
            "custom converters that replace the bridge's for these aten ops: pairs (overload name such "
            "as 'gelu.default', fn(node, importer) -> relax.Expr); a dict is accepted"
        ),
    )
    verbose: bool = field(default=False, metadata=_doc("print a one-line summary after each compile"))
    progress: bool | None = field(
        default=None, metadata=_doc("a progress bar over the compile stages (default: when stderr is a terminal)")
    )

    def __post_init__(self) -> None:
        if isinstance(self.converters, dict):  # frozen: normalise the accepted dict to pairs
            object.__setattr__(self, "converters", tuple(self.converters.items()))
        if not all(isinstance(k, str) and callable(f) for k, f in self.converters):
            raise ValueError("option converters must map aten overload names to callables fn(node, importer)")
        if not (callable(self.capture) or self.capture in CAPTURE_POLICIES):
            raise ValueError(
                f"unknown capture policy {self.capture!r}; choose one of {list(CAPTURE_POLICIES)} "
                "or pass a callable JointGraph -> list of value names"
            )
        _check_budget(self.memory_budget, self.capture)
        if not (self.offload_matmul in (None, True, False) or self.offload_matmul in GEMM_BACKENDS):
            raise ValueError(
                f"unknown matmul backend offload_matmul={self.offload_matmul!r}; choose one of "
                f"{list(GEMM_BACKENDS)}, True (= 'auto'), False (TVM's own kernels) or None (device default)"
            )
        for name in (
            "fp_contract",
            "fast_math",
            "cpu_schedules",
            "fuse",
            "mask_kernel",
            "fallback",
            "compile_submodules",
            "warn_on_fallback",
            "verify",
            "verbose",
            "disk_cache",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"option {name} must be True or False, got {getattr(self, name)!r}")
        if not (self.dynamic in ("auto", False) or isinstance(self.dynamic, dict)):
            raise ValueError(
                f"option dynamic must be 'auto', False or {{argument: {{dim: name}}}}, got {self.dynamic!r}"
            )
        if (
            isinstance(self.cache_size_limit, bool)
            or not isinstance(self.cache_size_limit, int)
            or self.cache_size_limit < 1
        ):
            raise ValueError(f"option cache_size_limit must be an int >= 1, got {self.cache_size_limit!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ValueError(f"option progress must be True, False or None, got {self.progress!r}")

    def compile_key(self) -> str | None:
        """The options the compile's stages read, as text equal across processes; None where a
        callable (a capture policy, a converter) is among them: its code is not in the text, so
        no disk cache may answer for it."""
        if callable(self.capture) or self.converters:
            return None
        return repr({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in RUNTIME_ONLY})

    def replace(self, **changes: Any) -> CompileOptions:
        """A copy with ``changes`` applied (checked like the constructor's arguments)."""
        return with_overrides(self, changes)

    def gemm_backend(self, device_type: str) -> str | None:
        """The offload backend for a device (None: TVM's own matmul kernels). Off the CPU only
        ``torch`` (cuBLAS/hipBLAS) runs a GPU's tensors: ``True``/``'auto'`` mean it there, and
        ``'onednn'`` (a CPU library) is an error that says so."""
        choice = self.offload_matmul
        if choice is None:
            choice = device_type == "cpu"
        if choice is False:
            return None
        backend = "auto" if choice is True else str(choice)
        if device_type != "cpu" and backend == "onednn":
            raise ValueError(
                f"offload_matmul='onednn' runs on the CPU only; on {device_type} use 'torch' (its GEMM "
                "library through torch.matmul) or False (TVM's own kernels)"
            )
        return backend if device_type == "cpu" else "torch"

    @property
    def policy_name(self) -> str:
        return self.capture if isinstance(self.capture, str) else getattr(self.capture, "__name__", "custom")


FIELD_HELP: dict[str, str] = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(CompileOptions)}


def _check_budget(budget: int | float | None, capture: Any) -> None:
    if budget is None:
        return
    if capture != "min-cut":
        raise ValueError("memory_budget applies to capture='min-cut' only")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"memory_budget must be bytes (int) or a fraction (float), got {budget!r}")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(f"memory_budget as a fraction must be in (0, 1], got {budget}")
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"memory_budget in bytes must be >= 0, got {budget}")


def with_overrides(options: CompileOptions | None, overrides: dict[str, Any]) -> CompileOptions:
    """``options`` (default: the defaults) with keyword ``overrides``; an unknown name is an error
    that lists the known ones."""
    base = options if options is not None else CompileOptions()
    if not isinstance(base, CompileOptions):
        raise TypeError(f"options must be a tvmbridge.CompileOptions, got {type(base).__name__}")
    unknown = sorted(set(overrides) - set(FIELD_HELP))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; the options are {sorted(FIELD_HELP)}")
    return dataclasses.replace(base, **overrides) if overrides else base


# --- command line ---------------------------------------------------------------------------
def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parse_offload(text: str) -> bool | str:
    lowered = text.lower()
    if lowered in ("0", "false", "no", "off", "none"):
        return False
    return lowered


def _parse_budget(text: str) -> int | float:
    return float(text) if any(c in text for c in ".eE") else int(text)


_CLI_TYPES: dict[str, Callable[[str], Any]] = {
    "capture": str,
    "tuning_db": str,
    "memory_budget": _parse_budget,
    "offload_matmul": _parse_offload,
    "cache_size_limit": int,
    "dynamic": lambda text: False if text.lower() in ("0", "false", "no", "off") else text,
}


def add_option_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("progress", "converters")) -> None:
    """``--capture``, ``--memory-budget``, ``--fast-math true|false``, ...: one flag per option."""
    group = parser.add_argument_group("compile options")
    for f in dataclasses.fields(CompileOptions):
        if f.name in skip:
            continue
        kind = _CLI_TYPES.get(f.name, _parse_bool)
        group.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f"opt_{f.name}",
            type=kind,
            default=None,
            help=f"{FIELD_HELP[f.name]} (default: {f.default!r})",
        )


def options_from_args(args: argparse.Namespace) -> CompileOptions:
    """The options named on a command line built with :func:`add_option_arguments`."""
    given = {k.removeprefix("opt_"): v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    return with_overrides(None, given)
