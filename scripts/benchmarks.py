"""Peak-memory benchmark: PyTorch's order vs the optimizer rewrite vs the ILP scheduler.

    python scripts/benchmarks.py --time-limit 60 --out bench_results

For every model of analysis.models.MEMORY_BENCHMARK, train and eval mode, batch 1 and 32: imports one step
(fake tensors), simulates PyTorch's order and the rewrite, runs the scheduler with the time
limit, and writes results.csv, results.md and peaks.png under --out (appending row by row, so a
stopped run keeps what it measured). Needs no TVM and no GPU.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from analysis.memory.importer import import_eval_step, import_training_step  # noqa: E402
from analysis.memory.schedule import optimal_order, optimizer_rewrite  # noqa: E402
from analysis.memory.simulate import simulate  # noqa: E402
from analysis.models import MEMORY_BENCHMARK, build  # noqa: E402

FIELDS = ["model", "mode", "batch", "nodes", "edges", "peak_pytorch_MiB", "peak_rewrite_MiB",
          "peak_best_MiB", "lower_bound_MiB", "reduction_pct", "solve_s", "optimal", "method",
          "import_s"]
MIB = 2 ** 20


def run_one(model: str, mode: str, batch: int, time_limit: float, gap: float) -> dict:
    t0 = time.perf_counter()
    net, inputs = build(model, batch)
    net.train(mode == "train")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g, _ = (import_training_step if mode == "train" else import_eval_step)(net, inputs)
    t_import = time.perf_counter() - t0
    base = simulate(g).peak
    rewrite = simulate(g, optimizer_rewrite(g)).peak
    res = optimal_order(g, time_limit=time_limit, mip_rel_gap=gap)
    g.check_order(res.order)
    return {
        "model": model, "mode": mode, "batch": batch, "nodes": len(g.nodes),
        "edges": len(g.edges), "peak_pytorch_MiB": round(base / MIB, 2),
        "peak_rewrite_MiB": round(rewrite / MIB, 2), "peak_best_MiB": round(res.peak / MIB, 2),
        "lower_bound_MiB": "" if res.lower_bound is None else round(res.lower_bound / MIB, 2),
        "reduction_pct": round(100 * (base - res.peak) / base, 1),
        "solve_s": round(res.solve_time, 1),
        "optimal": "yes" if res.optimal else "no (best found)", "method": res.method,
        "import_s": round(t_import, 1),
    }


def markdown(rows: list[dict]) -> str:
    head = ("| model | mode | batch | nodes | edges | PyTorch order (MiB) | rewrite (MiB) | "
            "best (MiB) | reduction | solve (s) | optimal | method |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['nodes']} | {r['edges']} "
                     f"| {r['peak_pytorch_MiB']} | {r['peak_rewrite_MiB']} | {r['peak_best_MiB']} "
                     f"| {r['reduction_pct']}% | {r['solve_s']} | {r['optimal']} | {r['method']} |")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{r['model']}\n{r['mode']} b{r['batch']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(rows)), 5))
    for i, (key, name) in enumerate([("peak_pytorch_MiB", "PyTorch order"),
                                     ("peak_rewrite_MiB", "optimizer rewrite"),
                                     ("peak_best_MiB", "scheduler")]):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=name)
    ax.set_xticks(x, labels, rotation=90, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("simulated peak memory (MiB, log)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MEMORY_BENCHMARK), choices=list(MEMORY_BENCHMARK))
    ap.add_argument("--modes", nargs="+", default=["train", "eval"], choices=["train", "eval"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--time-limit", type=float, default=300.0,
                    help="scheduler seconds per graph (default 300)")
    ap.add_argument("--gap", type=float, default=1e-4, help="HiGHS relative MIP gap")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(m, mode, b) for m in args.models for mode in args.modes for b in args.batches]
    rows: list[dict] = []
    with open(args.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for model, mode, batch in (bar := tqdm(jobs, unit="graph")):
            bar.set_description(f"{model} {mode} b{batch}")
            try:
                rows.append(run_one(model, mode, batch, args.time_limit, args.gap))
            except Exception as err:  # one broken model must not lose the others' rows
                tqdm.write(f"{model} {mode} b{batch}: {type(err).__name__}: {err}")
                continue
            writer.writerow(rows[-1])
            f.flush()
            (args.out / "results.md").write_text(markdown(rows))
    chart(rows, args.out / "peaks.png")
    print(markdown(rows))
    print(f"scheduler time limit {args.time_limit:g} s per graph; wrote {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
