"""Tune a module's kernels with MetaSchedule: what ``tvmbridge tune`` and ``scripts/tune.py`` run.

The module is compiled as dispatch would compile it (training: forward and backward; or an
inference compile) with the work directory as its tuning database, so the GEMM library choices
are measured into it too; its unscheduled kernels become MetaSchedule tasks, tuned in turn
(``backend.tuning``). Later compiles given ``tuning_db=work_dir`` use the records.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backend.build import lower
from ..backend.tuning import TaskResult, extract_tasks, open_database, tune_tasks
from ..devices import target_for
from ..options import CompileOptions, with_overrides

HEADER = f"{'kernel':48s} {'calls':>5s} {'MFLOP':>10s} {'default ms':>9s} {'tuned ms':>9s} {'trials':>6s}"


def tune_module(
    module: torch.nn.Module,
    sample_inputs: Any,
    sample_kwargs: dict | None = None,
    *,
    work_dir: str,
    trials_per_task: int = 64,
    max_trials: int | None = None,
    inference: bool = False,
    options: CompileOptions | None = None,
    progress: bool = True,
    time_budget_s: float | None = None,
) -> list[TaskResult]:
    """Tune every kernel TVM keeps for this call into ``work_dir``; one result per kernel."""
    tasks, target = module_tasks(
        module, sample_inputs, sample_kwargs, work_dir=work_dir, inference=inference, options=options
    )
    return tune_tasks(tasks, target, work_dir, trials_per_task, max_trials, progress, time_budget_s)


def module_tasks(
    module: torch.nn.Module,
    sample_inputs: Any,
    sample_kwargs: dict | None = None,
    *,
    work_dir: str,
    inference: bool = False,
    options: CompileOptions | None = None,
) -> tuple[list[Any], Any]:
    """MetaSchedule's tasks for the kernels TVM keeps in this call's compile, and their target."""
    opts = with_overrides(options, {"tuning_db": str(work_dir)})
    open_database(work_dir, create=True)
    args = sample_inputs if isinstance(sample_inputs, tuple) else (sample_inputs,)
    if inference:
        from ..runtime.inference import compile_inference

        forward_only = compile_inference(module, args, sample_kwargs, options=opts)
        relax_mod, device = forward_only.stages, forward_only.device
    else:
        from ..runtime.compiled import compile_training

        compiled = compile_training(module, args, sample_kwargs, options=opts)
        relax_mod, device = compiled.stages["fast_math"], compiled.device
    if device.type != "cpu":
        raise NotImplementedError("tuning runs on CPU here; GPU tuning needs a device to measure on")
    target = target_for(device, opts.fp_contract)
    return extract_tasks(lower(relax_mod, target, schedule=False), target), target


def table(results: list[TaskResult]) -> str:
    """One row per kernel, then the kernels' time per call of the module: default and tuned (each
    kernel's best of the two, as a compile with the database takes it)."""
    timed = [(r.calls, r.default_ms, r.tuned_ms) for r in results if r.default_ms is not None]
    before = sum(calls * default for calls, default, _ in timed)
    after = sum(calls * min(default, tuned if tuned is not None else default) for calls, default, tuned in timed)
    total = (
        f"TVM kernels per call ({len(timed)} of {len(results)} timed): default {before:.3f} ms, tuned {after:.3f} ms"
    )
    return "\n".join([HEADER, *map(str, results), total])
