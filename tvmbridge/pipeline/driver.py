"""The driver: runs stages in order, times them, keeps what each made, names the failing one.

A stage sees only the fields it declares (``Stage.reads`` and ``Stage.writes``): any other reads
as a :class:`Undeclared` placeholder that raises on use, and a field it returns changed that it
does not declare writing is an error. So the declarations are the stage's real dependencies.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, NoReturn

from tqdm import tqdm

from ..errors import stage_errors
from .artifacts import Artifacts, Stage
from .collector import older_objects_frozen


class Undeclared:
    """A field a stage did not declare: using it raises, naming the stage and the field."""

    def __init__(self, stage: str, name: str) -> None:
        object.__setattr__(self, "_where", (stage, name))

    def _refuse(self, *args: Any) -> NoReturn:
        stage, name = object.__getattribute__(self, "_where")
        raise RuntimeError(f"stage {stage} reads Artifacts.{name}, which it does not declare in Stage.reads")

    def __getattr__(self, attr: str) -> Any:
        self._refuse()

    __bool__ = __len__ = __iter__ = __getitem__ = __eq__ = __hash__ = __call__ = _refuse


def run_stage(stage: Stage, artifacts: Artifacts) -> Artifacts:
    """``stage`` on the fields it declares; the others pass through untouched."""
    declared = {*stage.reads, *stage.writes}
    # placeholders in fields of every type: what the stage may not read
    hidden: dict[str, Any] = {
        f.name: Undeclared(stage.name, f.name) for f in dataclasses.fields(Artifacts) if f.name not in declared
    }
    made = stage.run(dataclasses.replace(artifacts, **hidden))
    changed = [n for n, placeholder in hidden.items() if getattr(made, n) is not placeholder]
    if changed:
        raise RuntimeError(
            f"stage {stage.name} changed Artifacts.{', '.join(changed)}, which it does not declare in Stage.writes"
        )
    return dataclasses.replace(made, **{n: getattr(artifacts, n) for n in hidden})


def run_stages(artifacts: Artifacts, stages: tuple[Stage, ...]) -> tuple[Artifacts, dict[str, Any], dict[str, float]]:
    """Run ``stages`` in order: the final artifacts, what each stage made, seconds per stage."""
    shown: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    progress = artifacts.options.progress
    show_bar = sys.stderr.isatty() if progress is None else progress
    t_start = time.perf_counter()
    with older_objects_frozen():
        artifacts = _run_in_order(artifacts, stages, shown, seconds, show_bar)
    seconds["total"] = time.perf_counter() - t_start
    return artifacts, shown, seconds


def _run_in_order(
    artifacts: Artifacts, stages: tuple[Stage, ...], shown: dict[str, Any], seconds: dict[str, float], show_bar: bool
) -> Artifacts:
    for stage in tqdm(stages, desc="tvmbridge compile", unit="stage", disable=not show_bar, leave=False):
        t = time.perf_counter()
        with stage_errors(stage.name):
            artifacts = run_stage(stage, artifacts)
            shown[stage.name] = stage.shows(artifacts)
        seconds[stage.name] = time.perf_counter() - t
    return artifacts
