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
