"""MetaSchedule tuning of the kernels TVM keeps, into one database that later compiles apply.

The tasks are the fused TIR kernels of a compiled module's forward and backward (and of an
inference compile): what ``build.lower`` makes before scheduling, extracted with MetaSchedule's
``extract_tasks``. Matmuls offloaded to a GEMM library are not kernels of TVM and are not tuned
(their library is chosen by measurement, ``gemm_choice``). Each task is tuned on its own
(evolutionary search, XGBoost cost model) under a per-task trial budget, into a JSON database in
a work directory shared by all tasks; a task that already has records there is skipped, so a
second run resumes. A compile given the database (``tuning_db=``) takes each kernel's best
record; kernels without one keep the bridge's default schedule.
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tvm import relax
from tvm.s_tir import analysis as s_tir_analysis

DATABASE_FILES = ("database_workload.json", "database_tuning_record.json")


@dataclass
class TaskResult:
    """One tuned kernel: its name, FLOPs, the default schedule's latency, the best tuned one."""

    name: str
    flops: float
    default_ms: float | None
    tuned_ms: float | None
    trials: int
    resumed: bool = False

    def __str__(self) -> str:
        fmt = lambda v: f"{v:9.3f}" if v is not None else "      n/a"  # noqa: E731
        note = " (records found: resumed)" if self.resumed else ""
        return f"{self.name[:48]:48s} {self.flops / 1e6:10.2f} {fmt(self.default_ms)} {fmt(self.tuned_ms)} {self.trials:6d}{note}"


def open_database(work_dir: str | os.PathLike, create: bool = False) -> Any | None:
    """The JSON database in ``work_dir``; None (with a warning) when it is missing or unreadable,
    so that a compile falls back to the default schedules instead of failing inside TVM."""
    from tvm.s_tir import meta_schedule as ms

    path = Path(work_dir)
    if not create and not all((path / f).is_file() for f in DATABASE_FILES):
        warnings.warn(f"tvmbridge: no tuning database in {path} (expected {', '.join(DATABASE_FILES)}); "
                      "using the default schedules", stacklevel=3)
        return None
    path.mkdir(parents=True, exist_ok=True)
    for name in DATABASE_FILES:
        (path / name).touch()
    try:
        return ms.database.JSONDatabase(work_dir=str(path), allow_missing=create)
    except Exception as exc:  # noqa: BLE001 - TVM raises its own errors for a corrupt file
        warnings.warn(f"tvmbridge: the tuning database in {path} cannot be read ({str(exc).splitlines()[0][:200]}); "
                      "using the default schedules", stacklevel=3)
        return None


def apply_database(mod: tvm.IRModule, target: tvm.target.Target, database: Any) -> tuple[tvm.IRModule, list[str]]:
    """Every kernel of ``mod`` with a record takes its best one (marked scheduled, so the default
    rules leave it); returns the module and the kernels that had none."""
    with target, database:
        tuned = relax.transform.MetaScheduleApplyDatabase()(mod)
    missing = [gv.name_hint for gv, f in tuned.functions_items()
               if isinstance(f, tvm.tirx.PrimFunc) and not f.attrs.get("tir.is_scheduled", False)]
    return tuned, missing


def extract_tasks(lowered: tvm.IRModule, target: tvm.target.Target) -> list[Any]:
    """MetaSchedule's tasks for the unscheduled kernels of a lowered module (one per distinct
    kernel; ``weight`` counts its calls)."""
    from tvm.s_tir import meta_schedule as ms

    return list(ms.relax_integration.extract_tasks(lowered, target))


def _latency_ms(mod: tvm.IRModule, target: tvm.target.Target, runs: int = 5) -> float | None:
    """Median latency of a one-kernel module built as it is (its own schedule), on CPU."""
    import numpy as np

    try:
        func = mod["main"]
        lib = tvm.compile(mod, target=target).mod
        dev = tvm.cpu()
        from tvm.s_tir.meta_schedule.arg_info import ArgInfo

        infos = ArgInfo.from_prim_func(func)
        args = [tvm.runtime.tensor(np.zeros([int(d) for d in a.shape], str(a.dtype)), dev) for a in infos]
        timer = lib.time_evaluator("main", dev, number=3, repeat=runs)
        return float(np.median(timer(*args).results)) * 1e3
    except Exception:  # noqa: BLE001 - symbolic shapes or an odd kernel: no figure
        return None


def default_schedule(task_mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    from .cpu_schedules import apply_cpu_schedules

    return apply_cpu_schedules(task_mod, target) if target.kind.name == "llvm" else task_mod


def tune_tasks(tasks: list[Any], target: tvm.target.Target, work_dir: str | os.PathLike, trials_per_task: int,
               max_trials: int | None = None, progress: bool = True) -> list[TaskResult]:
    """Tune each task in turn into the database in ``work_dir`` (see the module docstring)."""
    from tqdm import tqdm
    from tvm.s_tir import meta_schedule as ms

    database = open_database(work_dir, create=True)
    if database is None:
        raise RuntimeError(f"cannot open or create a tuning database in {work_dir}")
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    results, spent = [], 0
    for task in tqdm(tasks, desc="tvmbridge tune", unit="task", disable=not progress):
        budget = trials_per_task if max_trials is None else max(0, min(trials_per_task, max_trials - spent))
        results.append(_tune_one(task, target, work_dir, database, budget, ms))
        spent += results[-1].trials
    return results


def _tune_one(task: Any, target: tvm.target.Target, work_dir: Any, database: Any, budget: int, ms: Any) -> TaskResult:
    mod = task.dispatched[0]
    flops = float(s_tir_analysis.estimate_tir_flops(mod))
    default_ms = _latency_ms(default_schedule(mod, target), target)
    done = database.has_workload(mod)  # tuned in an earlier run (its records may all be failures)
    if done or budget <= 0:
        return TaskResult(task.task_name, flops, default_ms, _best_ms(database, mod), 0, resumed=bool(done))
    ctx = ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply", search_strategy="evolutionary",
                         task_name=task.task_name)
    ms.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=str(work_dir), max_trials_global=budget,
                  max_trials_per_task=budget, num_trials_per_iter=min(budget, 16), database=database,
                  cost_model="xgb")
    return TaskResult(task.task_name, flops, default_ms, _best_ms(database, mod), budget)


def _best_ms(database: Any, mod: tvm.IRModule) -> float | None:
    if not database.has_workload(mod):
        return None
    top = database.get_top_k(database.commit_workload(mod), 1)
    if not top or not top[0].run_secs:
        return None
    secs = [float(s) for s in top[0].run_secs]
    return sum(secs) / len(secs) * 1e3
