"""MetaSchedule tuning database: applied where it has records, harmless where it is missing or
corrupt, resumable."""
from __future__ import annotations

import functools
import json
import tempfile
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


def _tuning_warnings(tuning_db: str) -> list[str]:
    """Compile and run Tiny with the database (PyTorch's numbers asserted); the tuning warnings."""
    from tvmbridge.backend.build import _note_tuning

    _note_tuning.cache_clear()  # each is said once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _same_as_pytorch(tuning_db)
    return [str(w.message) for w in caught if "tuning database" in str(w.message)]


@functools.cache
def _measured_defaults() -> tuple:
    """Tiny's kernels with their default schedules measured (as a tuning run commits them), once
    per session: each measurement starts a build and a run process (seconds per kernel)."""
    from tvm.s_tir import meta_schedule as ms

    from tvmbridge.backend.tuning import _recording_builder, default_record, open_database
    from tvmbridge.tools.tune import module_tasks

    with tempfile.TemporaryDirectory() as work_dir:
        tasks, target = module_tasks(Tiny(), (torch.randn(4, 16),), work_dir=work_dir)
        database = open_database(work_dir, create=True)
        builder, runner = _recording_builder(), ms.runner.LocalRunner()
        measured = []
        for task in tasks:
            mod = task.dispatched[0]
            record = default_record(mod, target, database.commit_workload(mod), builder, runner)
            assert record is not None and 0 < float(record.run_secs[0]) < 1, task.task_name
            measured.append((mod, record))
    return tuple(measured)


def _database_of_defaults(tmp_path, retarget=None, schedule=None) -> list:
    """A database in ``tmp_path`` with one record per kernel of Tiny's compile: the measured
    default schedule, or ``schedule(task module)``'s trace, made for ``retarget`` instead of this
    machine when given."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from tvmbridge.backend.tuning import open_database

    database = open_database(tmp_path, create=True)
    records = []
    for mod, measured in _measured_defaults():
        trace, run_secs, target = measured.trace, measured.run_secs, measured.target
        if schedule is not None and (custom := schedule(mod)) is not None:
            trace, run_secs = custom, [1e-9]
        if retarget is not None:
            target = tvm.target.Target(retarget)
        record = ms.database.TuningRecord(trace, database.commit_workload(mod), run_secs=run_secs,
                                          target=target, args_info=measured.args_info)
        database.commit_tuning_record(record)
        records.append(record)
    return records


def test_records_made_for_the_tasks_apply_to_the_compile(tmp_path):
    """A database holding a record for every task covers every kernel of the compile: no kernel
    reported untuned, and PyTorch's numbers."""
    _database_of_defaults(tmp_path)
    assert _tuning_warnings(str(tmp_path)) == []


@pytest.mark.parametrize(
    "other",
    [{"kind": "cuda", "arch": "sm_90"}, {"kind": "llvm", "mcpu": "another cpu"}],
)
def test_records_for_another_target_are_ignored_with_a_warning(tmp_path, other):
    """A database tuned on another machine (a GPU, or another CPU model) is not applied here: a
    warning names the target, the kernels keep the default schedules, the numbers are PyTorch's."""
    from tvmbridge.devices import target_for

    here = target_for(torch.device("cpu"))
    if other.get("mcpu") == "another cpu":
        other = {**here.export(), "mcpu": "znver4" if here.attrs.get("mcpu") != "znver4" else "skylake-avx512"}
    _database_of_defaults(tmp_path, retarget=other)
    said = _tuning_warnings(str(tmp_path))
    assert any("records for another target" in m and other.get("mcpu", other.get("arch")) in m for m in said), said
    assert any("have no record" in m for m in said), said


def test_a_record_that_does_not_compile_leaves_the_database_out(tmp_path):
    """A record for this target whose schedule replays but does not compile (here a loop bound
    to a GPU thread) makes the compile warn and use the default schedules; it does not fail."""
    import tvm

    def gpu_bound(mod):
        sch = tvm.s_tir.Schedule(mod)
        block = sch.get_child_blocks(sch.get_sblock("root"))[0] if sch.get_child_blocks(sch.get_sblock("root")) else None
        try:
            sch.bind(sch.get_loops(block)[0], "threadIdx.x")
        except Exception:  # noqa: BLE001 - a reduction loop: this kernel keeps its default
            return None
        return sch.trace

    _database_of_defaults(tmp_path, schedule=gpu_bound)
    said = _tuning_warnings(str(tmp_path))
    assert any("failed" in m and "default schedules" in m for m in said), said


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


def test_records_cache_is_bounded_and_reads_once():
    """The records read from tuning databases: a few entries, least recently used evicted first,
    each read once even when threads ask together, a missing database (None) not kept."""
    import threading
    import time

    from tvmbridge.caches import BoundedCache

    cache, reads = BoundedCache(2), []

    def reader(key):
        def read():
            reads.append(key)
            time.sleep(0.01)
            return None if key == "missing" else f"records of {key}"
        return read

    threads = [threading.Thread(target=cache.get_or_make, args=("a", reader("a"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reads == ["a"] and cache.get_or_make("a", reader("a")) == "records of a"
    assert cache.get_or_make("missing", reader("missing")) is None and len(cache) == 1
    cache.get_or_make("b", reader("b"))
    cache.get_or_make("a", reader("a"))  # a is now the most recent
    cache.get_or_make("c", reader("c"))  # evicts b
    assert len(cache) == 2 and reads == ["a", "missing", "b", "c"]
    cache.get_or_make("b", reader("b"))
    assert reads[-1] == "b"
