"""MetaSchedule tuning of the kernels TVM keeps, into one database that later compiles apply.

The tasks are the fused TIR kernels of a compiled module's forward and backward (and of an
inference compile): what ``build.lower`` makes before scheduling, extracted with MetaSchedule's
``extract_tasks``. Matmuls offloaded to a GEMM library are not kernels of TVM and are not tuned
(their library is chosen by measurement, ``gemm_choice``). Each task is tuned on its own
(evolutionary search, XGBoost cost model) under a per-task trial budget, into a JSON database in
a work directory shared by all tasks; a task that already has records there is skipped, so a
second run resumes. A compile given the database (``tuning_db=``) takes each kernel's best
record; kernels without one keep the bridge's default schedule. The default schedule of each tuned
kernel is measured by the same runner and committed as a record too, so a compile never takes a
tuned schedule slower than the default.

Candidates are built by ``build_candidate`` rather than MetaSchedule's default build, which
imports every tensor intrinsic TVM has (CUDA's among them) in each fresh build worker; on a small
machine that import alone ran past the builder's timeout, so every candidate of a kernel failed.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm import relax
from tvm.s_tir import analysis as s_tir_analysis

from . import codegen
from .flatten_hazard import flatten_hazard

DATABASE_FILES = ("database_workload.json", "database_tuning_record.json")


BUILD_TIMEOUT_S = 120.0


@dataclass
class TaskResult:
    """One tuned kernel: its name, FLOPs, the default schedule's latency, the best tuned one, and
    how many of its measured candidates failed (with the first build error, when one did)."""

    name: str
    flops: float
    default_ms: float | None
    tuned_ms: float | None
    trials: int
    resumed: bool = False
    failed: int = 0
    error: str | None = None
    calls: int = 1

    def __str__(self) -> str:
        fmt = lambda v: f"{v:9.3f}" if v is not None else "      n/a"  # noqa: E731
        notes = [
            " (records found: resumed)" if self.resumed else "",
            f" ({self.failed} failed" + (f": {self.error}" if self.error else "") + ")" if self.failed else "",
        ]
        return (
            f"{self.name[:48]:48s} {self.calls:5d} {self.flops / 1e6:10.2f} {fmt(self.default_ms)} "
            f"{fmt(self.tuned_ms)} {self.trials:6d}{''.join(notes)}"
        )


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params: Any) -> Any:
    """MetaSchedule's default build, less its import of every tensor intrinsic: a scheduled
    candidate carries its tensorized bodies already, so the build worker needs none of them."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)


def default_trace(mod: tvm.IRModule, target: tvm.target.Target) -> tuple[tvm.IRModule, Any] | None:
    """A task's kernel under its default CPU schedule, and that schedule's trace; None when no
    rule takes it or the trace does not replay to the same kernel."""
    from .cpu_schedules import default_cpu_schedule

    if target.kind.name != "llvm" or (sch := default_cpu_schedule(mod["main"], target)) is None:
        return None
    replayed = tvm.s_tir.Schedule(mod)
    sch.trace.apply_to_schedule(replayed, remove_postproc=False)
    if not tvm_ffi.structural_equal(replayed.mod["main"], sch.mod["main"]):
        return None
    return sch.mod, sch.trace


def default_record(
    mod: tvm.IRModule, target: tvm.target.Target, workload: Any, builder: Any, runner: Any
) -> Any | None:
    """The default CPU schedule of a task's kernel as a tuning record, measured by ``runner``;
    None when ``default_trace`` has none or it fails to build or run."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo
    from tvm.s_tir.meta_schedule.builder import BuilderInput
    from tvm.s_tir.meta_schedule.database import TuningRecord
    from tvm.s_tir.meta_schedule.runner import RunnerInput

    if (default := default_trace(mod, target)) is None:
        return None
    scheduled, trace = default
    built = builder.build([BuilderInput(scheduled, target)])[0]
    if built.error_msg:
        return None
    args_info = ArgInfo.from_prim_func(mod["main"])
    ran = runner.run([RunnerInput(built.artifact_path, "cpu", args_info)])[0].result()
    if ran.error_msg or not ran.run_secs:
        return None
    return TuningRecord(trace, workload, run_secs=ran.run_secs, target=target, args_info=args_info)


def _recording_builder() -> Any:
    """A local builder (``build_candidate``, ``BUILD_TIMEOUT_S``) that keeps the first error it
    meets, so that a kernel whose candidates all fail can say why."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import LocalBuilder, PyBuilder

    @derived_object
    class RecordingBuilder(PyBuilder):
        def __init__(self) -> None:
            super().__init__()
            self.inner = LocalBuilder(f_build=build_candidate, timeout_sec=BUILD_TIMEOUT_S)
            self.errors: list[str] = []

        def build(self, build_inputs: list) -> list:
            results = self.inner.build(build_inputs)
            self.errors += [r.error_msg for r in results if r.error_msg]
            return results

    return RecordingBuilder()


def open_database(work_dir: str | os.PathLike, create: bool = False) -> Any | None:
    """The JSON database in ``work_dir``; None (with a warning) when it is missing or unreadable,
    so that a compile falls back to the default schedules instead of failing inside TVM."""
    from tvm.s_tir import meta_schedule as ms

    path = Path(work_dir)
    if not create and not all((path / f).is_file() for f in DATABASE_FILES):
        warnings.warn(
            f"tvmbridge: no tuning database in {path} (expected {', '.join(DATABASE_FILES)}); "
            "using the default schedules",
            stacklevel=3,
        )
        return None
    path.mkdir(parents=True, exist_ok=True)
    for name in DATABASE_FILES:
        (path / name).touch()
    try:
        return ms.database.JSONDatabase(work_dir=str(path), allow_missing=create)
    except Exception as exc:  # noqa: BLE001 - TVM raises its own errors for a corrupt file
        warnings.warn(
            f"tvmbridge: the tuning database in {path} cannot be read ({str(exc).splitlines()[0][:200]}); "
            "using the default schedules",
            stacklevel=3,
        )
        return None


TARGET_KEYS = ("mcpu", "arch", "mattr")  # what makes a schedule tuned for one chip wrong for another


def same_target(a: tvm.target.Target | None, b: tvm.target.Target) -> bool:
    """Whether a record made for ``a`` fits ``b``: the same kind and, where given, CPU or GPU model."""
    return (
        a is not None
        and a.kind.name == b.kind.name
        and all(str(a.attrs.get(k, "")) == str(b.attrs.get(k, "")) for k in TARGET_KEYS)
    )


def records_for(database: Any, target: tvm.target.Target) -> tuple[Any, list[str]]:
    """The database's records made for ``target``, in memory, and the other targets it holds
    records for. A schedule tuned elsewhere is not applied: a GPU schedule does not compile for a
    CPU, and a CPU schedule's vector widths and tiles were chosen for another chip."""
    from tvm.s_tir import meta_schedule as ms

    usable, foreign = ms.database.MemoryDatabase(), set()
    for rec in database.get_all_tuning_records():
        if not same_target(rec.target, target):
            foreign.add(str(rec.target) if rec.target is not None else "no target")
            continue
        workload = usable.commit_workload(rec.workload.mod)
        usable.commit_tuning_record(
            ms.database.TuningRecord(
                rec.trace, workload, run_secs=rec.run_secs, target=rec.target, args_info=rec.args_info
            )
        )
    return usable, sorted(foreign)


def apply_database(mod: tvm.IRModule, target: tvm.target.Target, database: Any) -> tuple[tvm.IRModule, list[str]]:
    """Every kernel of ``mod`` with a record takes its best one (marked scheduled, so the default
    rules leave it), unless TVM's flattening would miscompile that schedule
    (:func:`~.flatten_hazard.flatten_hazard`: the kernel is left to the default rules); returns the
    module and the kernels that took no record."""
    with target, database:
        tuned = relax.transform.MetaScheduleApplyDatabase()(mod)
    for gv, f in list(tuned.functions_items()):
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs.get("tirx.is_scheduled", False) and flatten_hazard(f):
            tuned[gv] = mod[gv.name_hint]
    missing = [
        gv.name_hint
        for gv, f in tuned.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and not f.attrs.get("tirx.is_scheduled", False)
    ]
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
        lib = tvm.compile(mod, target=target, tir_pipeline=codegen.tir_pipeline(target)).mod
        dev = tvm.cpu()
        from tvm.s_tir.meta_schedule.arg_info import ArgInfo

        infos = ArgInfo.from_prim_func(func)
        args = [tvm.runtime.tensor(np.zeros([int(d) for d in a.shape], str(a.dtype)), dev) for a in infos]
        timer = lib.time_evaluator("main", dev, number=3, repeat=runs)
        return float(np.median(timer(*args).results)) * 1e3
    except Exception:  # noqa: BLE001 - symbolic shapes or an odd kernel: no figure
        return None


def default_schedule(task_mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The task's kernel under the default schedule (a copy: the task's module stays the
    unscheduled workload that database records are keyed by)."""
    from .cpu_schedules import apply_cpu_schedules

    return apply_cpu_schedules(task_mod, target) if target.kind.name == "llvm" else task_mod


def tune_tasks(
    tasks: list[Any],
    target: tvm.target.Target,
    work_dir: str | os.PathLike,
    trials_per_task: int,
    max_trials: int | None = None,
    progress: bool = True,
    time_budget_s: float | None = None,
) -> list[TaskResult]:
    """Tune each task in turn into the database in ``work_dir`` (see the module docstring), the
    kernels that take the most time per call first (default latency times calls), so that a trial
    or time budget goes where it matters; once ``time_budget_s`` has passed, no further task starts."""
    from tqdm import tqdm
    from tvm.s_tir import meta_schedule as ms

    database = open_database(work_dir, create=True)
    if database is None:
        raise RuntimeError(f"cannot open or create a tuning database in {work_dir}")
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    measured = [
        (task, _latency_ms(default_schedule(task.dispatched[0], target), target))
        for task in tqdm(tasks, desc="default latencies", unit="kernel", disable=not progress)
    ]
    measured.sort(key=lambda tm: -(tm[1] or 0.0) * int(tm[0].weight))
    builder, runner = _recording_builder(), ms.runner.LocalRunner()
    results, spent, start = [], 0, time.monotonic()
    for task, default_ms in tqdm(measured, desc="tvmbridge tune", unit="task", disable=not progress):
        budget = trials_per_task if max_trials is None else max(0, min(trials_per_task, max_trials - spent))
        if time_budget_s is not None and time.monotonic() - start > time_budget_s:
            budget = 0
        results.append(_tune_one(task, default_ms, target, work_dir, database, builder, runner, budget, ms))
        spent += results[-1].trials
    return results


def _tune_one(
    task: Any,
    default_ms: float | None,
    target: tvm.target.Target,
    work_dir: Any,
    database: Any,
    builder: Any,
    runner: Any,
    budget: int,
    ms: Any,
) -> TaskResult:
    mod = task.dispatched[0]
    flops, calls = float(s_tir_analysis.estimate_tir_flops(mod)), int(task.weight)
    done = database.has_workload(mod)  # tuned in an earlier run (its records may all be failures)
    if done or budget <= 0:
        return TaskResult(
            task.task_name,
            flops,
            default_ms,
            _best_ms(database, mod),
            0,
            resumed=bool(done),
            failed=_failed(database, mod),
            calls=calls,
        )
    ctx = ms.TuneContext(
        mod=mod,
        target=target,
        space_generator="post-order-apply",
        search_strategy="evolutionary",
        task_name=task.task_name,
    )
    builder.errors.clear()
    ms.tune_tasks(
        tasks=[ctx],
        task_weights=[1.0],
        work_dir=str(work_dir),
        max_trials_global=budget,
        max_trials_per_task=budget,
        num_trials_per_iter=min(budget, 16),
        database=database,
        builder=builder,
        runner=runner,
        cost_model="xgb",
    )
    error = (
        builder.errors[0].strip().splitlines()[-1][:120] if builder.errors else None
    )  # the message, past any traceback
    trials, failed = len(_records(database, mod)), _failed(database, mod)
    # Measured by the runner that timed the candidates, so the compile takes whichever is faster.
    if (default := default_record(mod, target, database.commit_workload(mod), builder, runner)) is not None:
        database.commit_tuning_record(default)
        default_ms = _mean_ms(default.run_secs)
    return TaskResult(
        task.task_name, flops, default_ms, _best_ms(database, mod), trials, failed=failed, error=error, calls=calls
    )


FAILED_RUN_SECS = 1e9  # MetaSchedule records a candidate that failed to build or run as 1e10 s


def _records(database: Any, mod: tvm.IRModule) -> list[Any]:
    if not database.has_workload(mod):
        return []
    workload = database.commit_workload(mod)
    return [r for r in database.get_all_tuning_records() if r.workload.same_as(workload)]


def _failed(database: Any, mod: tvm.IRModule) -> int:
    return sum(1 for r in _records(database, mod) if not r.run_secs or max(map(float, r.run_secs)) >= FAILED_RUN_SECS)


def _best_ms(database: Any, mod: tvm.IRModule) -> float | None:
    if not database.has_workload(mod):
        return None
    top = database.get_top_k(database.commit_workload(mod), 1)
    if not top or not top[0].run_secs:
        return None
    return _mean_ms(top[0].run_secs)


def _mean_ms(run_secs: Any) -> float:
    secs = [float(s) for s in run_secs]
    return sum(secs) / len(secs) * 1e3
