"""One training step (forward + backward) of a BertLayer: TVM dispatch vs PyTorch eager, side by side.

Same process, same inputs, same seeds; median over --runs steps after --warmup; reports the ratio
TVM/eager and the compile time, and writes JSON and a markdown table (--out).

    python scripts/bench_train.py                     # shapes (1,14) and (8,128)
    python scripts/bench_train.py --shapes 1x14 --runs 30
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time

import torch

from tvmbridge import add_tvm_dispatch
from tvmbridge.demo import bert_layer


def step_time(module, x, mask, runs: int, warmup: int) -> list[float]:
    out = []
    for i in range(warmup + runs):
        torch.manual_seed(i)
        xi = x.detach().requires_grad_()
        t = time.perf_counter()
        y = module(xi, mask)
        y.sum().backward()
        dt = time.perf_counter() - t
        for p in module.parameters():
            p.grad = None
        if i >= warmup:
            out.append(dt)
    return out


def bench(batch: int, seq: int, runs: int, warmup: int, capture: str) -> dict:
    torch.manual_seed(0)
    layer = bert_layer()
    eager = copy.deepcopy(layer)
    x = torch.randn(batch, seq, 768)
    mask = torch.zeros(batch, 1, 1, seq)
    t0 = time.perf_counter()
    add_tvm_dispatch(layer, (x, mask), capture=capture)
    compile_s = time.perf_counter() - t0
    tvm_t = step_time(layer, x, mask, runs, warmup)
    assert layer._tvm_dispatch.calls_tvm == runs + warmup
    eager_t = step_time(eager, x, mask, runs, warmup)
    tvm_ms, eager_ms = statistics.median(tvm_t) * 1e3, statistics.median(eager_t) * 1e3
    return {
        "shape": f"({batch},{seq},768)", "capture": capture, "runs": runs,
        "tvm_ms": tvm_ms, "eager_ms": eager_ms, "ratio": tvm_ms / eager_ms,
        "compile_s": compile_s, "captured_MiB": layer._tvm_dispatch.compiled.captured_bytes() / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x14,8x128")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--capture", default="all")
    ap.add_argument("--out", default="bench_results/bench_train")
    args = ap.parse_args()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    rows = []
    for spec in args.shapes.split(","):
        b, s = (int(v) for v in spec.split("x"))
        print(f"benchmarking ({b},{s},768) ...", flush=True)
        rows.append(bench(b, s, args.runs, args.warmup, args.capture))
        print(json.dumps(rows[-1]), flush=True)
    table = ["| shape | capture | TVM step ms | eager step ms | TVM/eager | compile s | captured MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['shape']} | {r['capture']} | {r['tvm_ms']:.1f} | {r['eager_ms']:.1f} | {r['ratio']:.2f}x | {r['compile_s']:.1f} | {r['captured_MiB']:.2f} |")
    text = f"machine: {machine}\nmedian of {args.runs} runs after {args.warmup} warm-up\n\n" + "\n".join(table)
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
