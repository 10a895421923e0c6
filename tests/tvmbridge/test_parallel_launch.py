"""TVM's parallel loops on PyTorch's OpenMP threads (``parallel_launch``): the launcher
runs every task once on PyTorch's thread count, loses no error, serves the libraries the bridge
loads (built now or read from the disk cache), and turned off leaves TVM's pool in charge."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tvmbridge import add_tvm_dispatch, devices
from tvmbridge import parallel_launch
from tvmbridge.backend import build
from tvmbridge.backend.executable_cache import ExecutableCache

LAUNCHER = parallel_launch.launcher()
needs_launcher = pytest.mark.skipif(LAUNCHER is None, reason=f"no OpenMP launcher here ({parallel_launch.status()})")


@pytest.fixture
def threads():
    """Restores PyTorch's thread count after a test changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def launcher_off(monkeypatch):
    """The process as with ``TVMBRIDGE_OPENMP=0`` (the launcher looked up again after)."""
    monkeypatch.setenv("TVMBRIDGE_OPENMP", "0")
    parallel_launch.resolve.cache_clear()
    yield
    monkeypatch.undo()
    parallel_launch.resolve.cache_clear()


def _module(n: int = 1 << 16) -> tvm.IRModule:
    """One elementwise kernel, large enough that the CPU schedule makes its loop parallel."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(relax.op.multiply(x, x), relax.const(1.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


@needs_launcher
def test_every_task_runs_once_on_torch_s_thread_count(threads):
    result, seen = LAUNCHER.run_tasks()
    n = torch.get_num_threads()
    assert result == 0 and seen == [(t, n) for t in range(n)]
    torch.set_num_threads(1)
    assert LAUNCHER.run_tasks() == (0, [(0, 1)])
    assert LAUNCHER.run_tasks(3) == (0, [(0, 3), (1, 3), (2, 3)])  # a loop's own task count


@needs_launcher
def test_a_failing_task_fails_the_launch():
    assert LAUNCHER.run_tasks(2, fail_task=1)[0] != 0
    assert LAUNCHER.run_tasks(2)[0] == 0


@pytest.fixture
def disk_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TVMBRIDGE_DISK_CACHE", "1")
    monkeypatch.setenv("TVMBRIDGE_CACHE_DIR", str(tmp_path))
    return ExecutableCache()


@needs_launcher
def test_built_and_cached_libraries_run_their_loops_on_the_launcher(disk_cache):
    target = devices.target_for(torch.device("cpu"))
    mod = _module()
    x = np.random.default_rng(0).standard_normal(1 << 16).astype("float32")
    exe, loaded, key = build.compile_or_load(mod, target)  # built, stored, read back
    again, reloaded, _ = build.compile_or_load(mod, target, key=key)  # read back from the disk cache
    assert not loaded and reloaded
    for executable in (exe, again):
        vm = build.load(executable, torch.device("cpu"))
        before = LAUNCHER.launches()
        out = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_array_equal(out, x * x + np.float32(1.0))
        if int(target.attrs["num-cores"]) > 1:
            assert LAUNCHER.launches() > before


@needs_launcher
def test_two_threads_calling_one_model_at_once_get_their_own_results():
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 8))
    inputs = [torch.randn(64, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    add_tvm_dispatch(model, (inputs[0],))
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def run(i: int) -> None:
        with torch.no_grad():
            for _ in range(20):
                got[i].append(model(inputs[i]))

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for i in range(2):
        assert len(got[i]) == 20
        for y in got[i]:
            torch.testing.assert_close(y, expected[i], rtol=1e-5, atol=1e-5)


def test_the_target_has_torch_s_threads_with_the_launcher(monkeypatch):
    monkeypatch.delenv("TVMBRIDGE_NUM_CORES", raising=False)
    cores = int(devices.target_for(torch.device("cpu")).attrs["num-cores"])
    if LAUNCHER is not None:
        assert cores == torch.get_num_threads()
    monkeypatch.setenv("TVMBRIDGE_NUM_CORES", "3")
    assert int(devices.target_for(torch.device("cpu")).attrs["num-cores"]) == 3


def test_turned_off_tvm_s_pool_runs_the_loops(launcher_off, monkeypatch, tmp_path):
    monkeypatch.delenv("TVMBRIDGE_NUM_CORES", raising=False)
    assert parallel_launch.launcher() is None
    assert parallel_launch.status() == "TVM's pool (TVMBRIDGE_OPENMP=0)"
    threads = int(tvm.get_global_func("runtime.NumThreads")())
    assert int(devices.target_for(torch.device("cpu")).attrs["num-cores"]) == threads
    path = tmp_path / "lib.so"
    build.compile_module(_module(), devices.target_for(torch.device("cpu"))).export_library(str(path))
    parallel_launch.load_library(path)
    assert not parallel_launch.install(path)
