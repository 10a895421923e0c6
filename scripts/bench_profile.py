"""Benchmark of the meta profiler.

1. Time to `symbolic_profile` a 12-layer BERT-base encoder at batch 8, seq 128 (built and traced
   inside MetaTensorMode; goal: under 2 s). Best of --repeat runs, trace time reported apart.
2. Estimate vs measured memory for the test models: the profile's saved-for-backward bytes
   against a real forward measured with saved_tensors_hooks over unique storages.

    python scripts/bench_profile.py [--repeat 3] [--small]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from analysis import MetaTensorMode, measure_saved_bytes, symbolic_profile, symbolic_trace  # noqa: E402
from analysis.models import MODELS  # noqa: E402
from analysis.units import human_bytes, human_flops  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)


def bench_bert_base(repeat: int) -> None:
    with MetaTensorMode():
        model, margs = MODELS["bert-encoder"](batch=8, seq=128, layers=12)
    t0 = time.perf_counter()
    gm = symbolic_trace(model, margs)
    trace_s = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        symbolic_profile(gm, *margs.values())
        times.append(time.perf_counter() - t0)
    s = gm.meta["profile"]
    print(f"BERT-base encoder, 12 layers, batch 8, seq 128: {len(gm.graph.nodes)} nodes; "
          f"trace {trace_s:.2f} s; symbolic_profile best {min(times):.2f} s "
          f"(runs: {', '.join(f'{t:.2f}' for t in times)}); goal < 2 s: "
          f"{'met' if min(times) < 2 else 'NOT met'}")
    print(f"  forward {human_flops(s.fwd_flops)}, backward {human_flops(s.bwd_flops)}, "
          f"saved for backward {human_bytes(s.backward_bytes)}, peak activations "
          f"{human_bytes(s.peak_activation_bytes)}, parameters {human_bytes(s.param_bytes)}")


def bench_memory(small: bool) -> None:
    sizes = {
        "cnn": dict(batch=8, size=32),
        "bert": dict(batch=8, seq=128),
        "gpt2": dict(batch=8, seq=128),
    }
    if small:
        sizes = {"cnn": dict(batch=2, size=16), "bert": dict(batch=2, seq=16, hidden=64, heads=4),
                 "gpt2": dict(batch=2, seq=16, hidden=64, heads=4)}
    print(f"{'model':6} {'config':40} {'estimate':>12} {'measured':>12} {'error':>8} {'profile s':>9}")
    for name, kw in sizes.items():
        torch.manual_seed(0)
        model, margs = MODELS[name](**kw)
        t0 = time.perf_counter()
        gm = symbolic_profile(symbolic_trace(model, margs), *margs.values())
        dt = time.perf_counter() - t0
        est = gm.meta["profile"].backward_bytes
        _, real = measure_saved_bytes(model, *margs.values(),
                                      exclude=list(model.parameters()) + list(model.buffers()))
        err = (est - real) / real
        cfg = ", ".join(f"{k}={v}" for k, v in kw.items())
        print(f"{name:6} {cfg:40} {human_bytes(est):>12} {human_bytes(real):>12} {err:>+8.2%} {dt:>9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--small", action="store_true", help="small memory models (quick check)")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_bert_base(args.repeat)
    bench_memory(args.small)


if __name__ == "__main__":
    main()
