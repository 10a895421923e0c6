"""MetaSchedule tuning database: applied where it has records, harmless where it is missing or
corrupt, resumable."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.helpers import clone_module, is_tvm, max_errors, run_step
from tvmbridge import add_tvm_dispatch


class Tiny(torch.nn.Module):
    """A few TVM kernels (bias-GELU, a row reduction) around one offloaded matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.lin(x)).softmax(-1)


def _same_as_pytorch(tuning_db: str) -> None:
    m = Tiny()
    ref = clone_module(m)
    x = torch.randn(4, 16)
    add_tvm_dispatch(m, (x,), tuning_db=tuning_db)
    got, want = run_step(m, (x,)), run_step(ref, (x,))
    assert is_tvm(got[0][0]) and max(max_errors(got, want).values()) < 1e-5


def test_missing_database_warns_and_uses_defaults(tmp_path):
    with pytest.warns(UserWarning, match="no tuning database"):
        _same_as_pytorch(str(tmp_path / "nothing-here"))


def test_corrupt_database_warns_and_uses_defaults(tmp_path):
    for name in ("database_workload.json", "database_tuning_record.json"):
        (tmp_path / name).write_text("this is not json\n[1, 2\n")
    with pytest.warns(UserWarning, match="cannot be read"):
        _same_as_pytorch(str(tmp_path))


def test_default_schedules_leave_the_task_modules_unscheduled(tmp_path):
    """The database keys records by each task's module: scheduling a copy for the default latency
    must not mark the task's own module scheduled (its records would then match no compile)."""
    from tvmbridge.backend.tuning import default_schedule
    from tvmbridge.tools.tune import module_tasks

    tasks, target = module_tasks(Tiny(), (torch.randn(4, 16),), work_dir=str(tmp_path))
    for task in tasks:
        scheduled = default_schedule(task.dispatched[0], target)
        assert scheduled["main"].attrs.get("tirx.is_scheduled", False)
        assert not task.dispatched[0]["main"].attrs.get("tirx.is_scheduled", False)


def test_records_made_for_the_tasks_apply_to_the_compile(tmp_path):
    """A database holding a record for every task (here the measured default schedules, as a
    tuning run commits them) covers every kernel of the compile: no kernel reported untuned, and
    PyTorch's numbers."""
    from tvm.s_tir import meta_schedule as ms

    from tvmbridge.backend.tuning import _recording_builder, default_record, open_database
    from tvmbridge.tools.tune import module_tasks

    tasks, target = module_tasks(Tiny(), (torch.randn(4, 16),), work_dir=str(tmp_path))
    database = open_database(tmp_path, create=True)
    builder, runner = _recording_builder(), ms.runner.LocalRunner()
    for task in tasks:
        mod = task.dispatched[0]
        record = default_record(mod, target, database.commit_workload(mod), builder, runner)
        assert record is not None and 0 < float(record.run_secs[0]) < 1, task.task_name
        database.commit_tuning_record(record)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_as_pytorch(str(tmp_path))
    assert not [str(w.message) for w in caught if "no record in the tuning database" in str(w.message)]


@pytest.mark.slow
def test_tuned_database_is_applied_resumed_and_exact(tmp_path):
    """Tune a tiny module with a few trials per kernel: the compile with the database gives
    PyTorch's numbers; a second run with a larger budget resumes (tuned kernels are skipped) and
    adds records for the rest."""
    from tvmbridge.tools.tune import tune_module

    x = torch.randn(4, 16)
    first = tune_module(Tiny(), (x,), work_dir=str(tmp_path), trials_per_task=4, max_trials=4, progress=False)
    records = lambda: len((tmp_path / "database_tuning_record.json").read_text().splitlines())  # noqa: E731
    n_first = records()
    assert n_first > 0 and 0 < sum(r.trials for r in first) <= 4
    tuned = [r for r in first if r.trials]
    assert all(r.failed < r.trials for r in tuned), [str(r) for r in tuned]  # candidates build and run
    second = tune_module(Tiny(), (x,), work_dir=str(tmp_path), trials_per_task=4, progress=False)
    assert any(r.resumed for r in second) and records() > n_first
    assert json.loads((tmp_path / "gemm_choices.json").read_text())["format"] == 1  # GEMM choices live there too
    _same_as_pytorch(str(tmp_path))
