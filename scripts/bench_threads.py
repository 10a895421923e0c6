"""Concurrent calls of one dispatched module: a VM per call from a pool (the bridge's way) against
one shared VM behind a lock, and eager PyTorch, at 1, 2 and 4 threads. Training steps per second, medians
over rounds that interleave the variants.

    python scripts/bench_threads.py                 # BertLayer (1,14,768)
    python scripts/bench_threads.py --batch 8 --seq 128 --steps 3
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from analysis.models import bert_layer, bert_layer_inputs  # noqa: E402
from tvmbridge import add_tvm_dispatch  # noqa: E402


def one_vm_behind_a_lock(compiled) -> None:
    """Make ``compiled`` lend every call the same VM, one call at a time."""
    lock = threading.Lock()
    with compiled.vm() as shared:
        pass

    @contextlib.contextmanager
    def vm():
        with lock:
            yield shared

    compiled.vm = vm


def steps_per_second(module, x, mask, threads: int, steps: int) -> float:
    def work() -> None:
        for _ in range(steps):
            xi = x.detach().requires_grad_()
            module(xi, mask).sum().backward()

    pool = [threading.Thread(target=work) for _ in range(threads)]
    t = time.perf_counter()
    for p in pool:
        p.start()
    for p in pool:
        p.join()
    return threads * steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=14)
    ap.add_argument("--steps", type=int, default=20, help="steps per thread per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = bert_layer()
    x, mask = bert_layer_inputs(args.batch, args.seq)
    per_thread, locked, eager = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    add_tvm_dispatch(per_thread, (x, mask))
    add_tvm_dispatch(locked, (x, mask))
    one_vm_behind_a_lock(locked._tvm_dispatch.compiled)
    variants = {"vm-pool": per_thread, "shared-vm+lock": locked, "eager": eager}
    cpu = platform.processor() or platform.machine()
    print(f"{cpu}, {torch.get_num_threads()} torch threads; BertLayer ({args.batch},{args.seq},768) "
          f"train steps/s, median of {args.rounds} interleaved rounds")
    for threads in (1, 2, 4):
        rates: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, m in variants.items():
                rates[name].append(steps_per_second(m, x, mask, threads, args.steps))
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"  {threads} threads: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f"; pool / lock {med['vm-pool'] / med['shared-vm+lock']:.2f}x")
    assert per_thread._tvm_dispatch.calls_tvm > 0 and locked._tvm_dispatch.calls_tvm > 0


if __name__ == "__main__":
    main()
