"""The artifacts a compile makes, and the step that makes them.

Each stage declares the fields of :class:`Artifacts` it reads and those it writes; the driver
(``pipeline.driver``) checks both, so a stage that starts to depend on another's output, or
changes one it does not own, fails where it is written, not in a later stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import tvm

from ..backend.gemm_choice import GemmDecision
from ..frontend.export import TracedModule
from ..frontend.sites import RandomSite
from ..options import CompileOptions
from ..partition.joint import JointGraph
from ..partition.split import SplitResult
from ..passes import GradientResult
from .parts import TRAIN, Parts


@dataclass(frozen=True)
class Artifacts:
    """What the stages have made so far; each stage returns a new one. A field that starts as None
    is set by the stage that writes it; a stage reading it asserts it is set (the driver runs the
    stages in order, so it is)."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict
    options: CompileOptions
    device: torch.device | None = None
    dynamic: dict[int, frozenset[int]] | None = None  # call tensor -> dims to trace symbolically
    sizes: dict[str, int] = field(default_factory=dict)  # symbolic dims at this call (for costs)
    traced: TracedModule | None = None
    trace_loaded: bool = False  # what the decomposed program shows came from the trace cache
    primal: tvm.IRModule | None = None  # names.MAIN, through the passes before the gradient
    random_sites: tuple[RandomSite, ...] = ()
    num_index_checks: int = 0
    grad_param_indices: tuple[int, ...] = ()  # primal params (user inputs, then params) with a grad
    gradient: GradientResult | None = None
    joint: JointGraph | None = None
    captures: tuple[str, ...] = ()
    split: SplitResult | None = None
    halves: tvm.IRModule | None = None  # names.FORWARD, names.FORWARD_INFER, names.BACKWARD
    gemm_choices: tuple[GemmDecision, ...] = ()  # where each offloaded GEMM runs, and why
    first_part: str = TRAIN  # the part (pipeline.parts) the compile builds; the other when first needed
    parts: Parts | None = None  # the executables by part
    build_keys: dict[str, str] = field(default_factory=dict)  # part -> its executable's disk-cache key


@dataclass(frozen=True)
class Stage:
    """One step of the compile: ``run`` makes new artifacts from the fields named in ``reads``,
    changing only those in ``writes``; ``shows`` picks what to keep for inspection."""

    name: str
    run: Callable[[Artifacts], Artifacts]
    shows: Callable[[Artifacts], Any]
    reads: tuple[str, ...]
    writes: tuple[str, ...]

    def __post_init__(self) -> None:
        known = {f.name for f in fields(Artifacts)}
        unknown = [n for n in (*self.reads, *self.writes) if n not in known]
        if unknown:
            raise ValueError(f"stage {self.name} names fields Artifacts does not have: {unknown}")


INPUTS = ("module", "args", "kwargs", "options")  # what every compile starts from
