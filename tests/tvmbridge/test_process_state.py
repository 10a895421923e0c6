"""The bridge leaves the process's threads as it found them: TVM's thread pool, started by the
first compiled call, pins the thread that starts it to one core by default, and every thread or
process started from it after inherits that (PyTorch's OpenMP workers, a DataLoader's, the
compile's own threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, os, threading, torch
    from tvmbridge import add_tvm_dispatch
    before = sorted(os.sched_getaffinity(0))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    add_tvm_dispatch(model, (torch.randn(4, 8),))
    model(torch.randn(4, 8)).sum().backward()
    assert model._tvm_dispatch.calls_tvm == 1
    later = []
    t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))
    t.start(); t.join()
    print(json.dumps([before, sorted(os.sched_getaffinity(0)), later[0]]))
    """
)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="one CPU")
def test_a_compiled_call_leaves_the_process_on_every_core_it_had():
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_BIND_THREADS", "TVMBRIDGE_NUM_CORES")}
    env["TVMBRIDGE_DISK_CACHE"] = "0"
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    before, after, thread = json.loads(run.stdout.strip().splitlines()[-1])
    assert after == before and thread == before, run.stdout


def _recording(stage_name: str, seen: list) -> tuple:
    """The pipeline's stages with ``stage_name`` recording the collector's state when it runs."""
    import dataclasses
    import gc

    from tvmbridge import pipeline

    def wrap(stage):
        def run(artifacts):
            seen.append((gc.get_freeze_count(), gc.isenabled()))
            return stage.run(artifacts)

        return dataclasses.replace(stage, run=run)

    return tuple(wrap(s) if s.name == stage_name else s for s in pipeline.STAGES)


def test_a_compile_hides_older_objects_from_the_collector_and_gives_them_back(monkeypatch):
    """Full collections during a compile would walk every object of the process (a tenth of a
    cold compile, a third of a disk-cache load): the compile runs with them frozen, and after it
    the collector is as it was."""
    import gc

    import torch

    from tvmbridge import compile_training, pipeline

    seen: list = []
    monkeypatch.setattr(pipeline.stages, "STAGES", _recording("convert", seen))
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    compile_training(torch.nn.Linear(4, 3), (torch.randn(2, 4),))
    assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1]  # frozen while it ran, still collecting
    assert gc.get_freeze_count() == 0 and gc.isenabled()


@pytest.mark.parametrize("caller", ["froze", "disabled"])
def test_a_compile_leaves_a_caller_s_own_collector_settings_alone(monkeypatch, caller):
    import gc

    import torch

    from tvmbridge import compile_training

    calls: list = []
    monkeypatch.setattr(gc, "freeze", lambda real=gc.freeze: calls.append("freeze") or real())
    monkeypatch.setattr(gc, "unfreeze", lambda real=gc.unfreeze: calls.append("unfreeze") or real())
    gc.freeze() if caller == "froze" else gc.disable()
    try:
        calls.clear()
        compile_training(torch.nn.Linear(4, 3), (torch.randn(2, 4),))
        assert calls == []  # the caller's frozen objects stay frozen, a disabled collector stays off
        assert gc.isenabled() == (caller == "froze") and (gc.get_freeze_count() > 0) == (caller == "froze")
    finally:
        gc.unfreeze()
        gc.enable()


def test_the_collector_still_frees_what_a_compile_drops_and_concurrent_compiles_share_one_freeze():
    import gc
    import threading
    import weakref

    from tvmbridge.pipeline.collector import older_objects_frozen

    class Node:
        pass

    entered, release = threading.Event(), threading.Event()

    def other_compile() -> None:
        with older_objects_frozen():
            entered.set()
            release.wait(30)

    with older_objects_frozen():
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None  # the compile's own cyclic garbage is collected
        thread = threading.Thread(target=other_compile)
        thread.start()
        assert entered.wait(30)
    assert gc.get_freeze_count() > 0  # the other compile is still running: still frozen
    release.set()
    thread.join(30)
    assert gc.get_freeze_count() == 0
