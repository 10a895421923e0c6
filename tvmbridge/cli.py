"""Command line: ``python -m tvmbridge demo`` (the main job)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tvmbridge", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="train a BertLayer through TVM next to PyTorch")
    demo.add_argument("--batch", type=int, default=1)
    demo.add_argument("--seq", type=int, default=14)
    demo.add_argument("--steps", type=int, default=5, help="SGD steps compared against PyTorch")
    demo.add_argument("--timing-runs", type=int, default=20, help="interleaved steps timed after a warm-up")
    demo.add_argument("--capture", default="min-cut", help="capture-set policy: min-cut (default) or all")
    viz = sub.add_parser("viz", help="write SVG pictures of the built-in BertLayer's split")
    viz.add_argument("--out", default="bench_results/bert_split", help="path without extension")
    viz.add_argument("--small", action="store_true", help="a small BertLayer (hidden 64) for a readable picture")
    viz.add_argument("--seq", type=int, default=14)
    viz.add_argument("--capture", default="min-cut")
    viz.add_argument("--memory-budget", type=float, default=None)
    viz.add_argument("--stage", default="split", help="split, or a stage name: forward, backward, adjoint, dedup, ...")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from .demo import run

        run(batch=args.batch, seq=args.seq, steps=args.steps, capture=args.capture, timing_runs=args.timing_runs)
    elif args.cmd == "viz":
        _viz(args)
    return 0


def _viz(args: argparse.Namespace) -> None:
    import os

    import torch

    from .demo import bert_layer
    from .pipeline import compile_training
    from .visualize import visualize, visualize_split

    layer = bert_layer(64, 4, 128) if args.small else bert_layer()
    hidden = 64 if args.small else 768
    x, mask = torch.randn(1, args.seq, hidden), torch.zeros(1, 1, 1, args.seq)
    compiled = compile_training(layer, (x, mask), capture=args.capture, memory_budget=args.memory_budget)
    if args.stage == "split":
        graph = visualize_split(compiled)
    else:
        import tvm

        drawable = [k for k, v in compiled.stages.items() if isinstance(v, tvm.IRModule)]
        if args.stage not in drawable:
            raise SystemExit(f"tvmbridge viz: no Relax stage {args.stage!r}; choose split or one of {', '.join(drawable)}")
        mod = compiled.stages[args.stage]
        graph = visualize(mod[next(iter(mod.functions))])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    path = graph.render(args.out, format="svg", cleanup=True)
    print(f"{compiled.summary()}\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
