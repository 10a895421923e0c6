"""Command line: ``python -m tvmbridge demo`` (the main job), ``viz`` (pictures of a compile) and
``check`` (the double-precision check of a built-in model).

Both take every compile option as a flag (``--capture all``, ``--memory-budget 0.3``,
``--fast-math false``, ...), the same :class:`~tvmbridge.options.CompileOptions` the API takes.
"""

from __future__ import annotations

import argparse
import sys

from ..options import CompileOptions, add_option_arguments, options_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tvmbridge", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="train a BertLayer through TVM next to PyTorch")
    demo.add_argument("--batch", type=int, default=1)
    demo.add_argument("--seq", type=int, default=14)
    demo.add_argument("--steps", type=int, default=5, help="SGD steps compared against PyTorch")
    demo.add_argument("--timing-runs", type=int, default=20, help="interleaved steps timed after a warm-up")
    add_option_arguments(demo)
    viz = sub.add_parser("viz", help="write SVG pictures of the built-in BertLayer's compile")
    viz.add_argument("--out", default="bench_results/bert_split", help="path without extension")
    viz.add_argument("--small", action="store_true", help="a small BertLayer (hidden 64) for a readable picture")
    viz.add_argument("--seq", type=int, default=14)
    viz.add_argument(
        "--stage",
        default="split",
        help="'split' (the joint graph coloured by the split), a stage that holds Relax, "
        "or stage:function (e.g. offload:backward)",
    )
    add_option_arguments(viz)
    check = sub.add_parser(
        "check",
        help="compare TVM with PyTorch in float64 and float32 (outputs and every "
        "gradient): numerical noise, or a deviation and the first op that deviates",
    )
    check.add_argument(
        "--model",
        default="bert-layer",
        choices=("bert-layer", *_whole_models()),
        help="a small built-in model (whole models include their loss)",
    )
    check.add_argument("--tolerance", type=float, default=1e-10, help="largest float64 relative error called noise")
    add_option_arguments(check)
    _tune_parser(sub)
    return parser


def _tune_parser(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "tune",
        help="tune a built-in model's TVM kernels with MetaSchedule into a database "
        "that add_tvm_dispatch(..., tuning_db=DIR) applies",
    )
    tune.add_argument("--work-dir", required=True, help="the database directory (a second run resumes)")
    tune.add_argument(
        "--model",
        default="bert-layer",
        choices=("bert-layer", "bert-layer-base", *_whole_models()),
        help="bert-layer: a small BertLayer; bert-layer-base: BERT-base sizes, as bench_train.py times",
    )
    tune.add_argument("--batch", type=int, default=1)
    tune.add_argument("--seq", type=int, default=14)
    tune.add_argument("--trials-per-task", type=int, default=64)
    tune.add_argument("--max-trials", type=int, default=None, help="total trial budget over all kernels")
    tune.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="time budget: no kernel starts tuning after this (the costliest kernels go first)",
    )
    tune.add_argument("--inference", action="store_true", help="tune the inference compile instead of training")
    add_option_arguments(tune, skip=("progress", "converters", "tuning_db"))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if args.cmd == "demo":
        from .demo import run

        run(batch=args.batch, seq=args.seq, steps=args.steps, options=options, timing_runs=args.timing_runs)
    elif args.cmd == "viz":
        _viz(args, options)
    elif args.cmd == "check":
        return _check(args, options)
    elif args.cmd == "tune":
        _tune(args, options)
    return 0


def _builtin(name: str, batch: int = 2, seq: int = 14) -> tuple:
    """A built-in model and its sample call: ``bert-layer`` (small BertLayer), ``bert-layer-base``
    (BERT-base sizes) or a whole model."""
    if name in ("bert-layer", "bert-layer-base"):
        from analysis.models import bert_layer, bert_layer_inputs

        if name == "bert-layer-base":
            return bert_layer(), bert_layer_inputs(batch, seq), {}
        return bert_layer(64, 4, 128), bert_layer_inputs(batch, seq, 64), {}
    from .whole_models import build_task

    task = build_task(name, batch=batch, seq=seq)
    return task.model, task.args, task.kwargs


def _tune(args: argparse.Namespace, options: CompileOptions) -> None:
    from .tune import table, tune_module

    module, inputs, kwargs = _builtin(args.model, args.batch, args.seq)
    results = tune_module(
        module,
        inputs,
        kwargs,
        work_dir=args.work_dir,
        trials_per_task=args.trials_per_task,
        max_trials=args.max_trials,
        inference=args.inference,
        options=options,
        time_budget_s=None if args.minutes is None else args.minutes * 60,
    )
    print(table(results))
    print(f"database: {args.work_dir} (use: add_tvm_dispatch(..., tuning_db={args.work_dir!r}))")


def _whole_models() -> tuple[str, ...]:
    from .whole_models import WHOLE_MODELS

    return WHOLE_MODELS


def _check(args: argparse.Namespace, options: CompileOptions) -> int:
    from .check import check_double

    module, inputs, kwargs = _builtin(args.model)
    report = check_double(module, inputs, kwargs, tolerance=args.tolerance, options=options)
    print(f"{type(module).__name__}: TVM vs PyTorch\n{report}")
    return 0 if report.verdict == "noise" else 1


def _viz(args: argparse.Namespace, options: CompileOptions) -> None:
    import os

    from analysis.models import bert_layer, bert_layer_inputs

    from ..runtime.compiled import compile_training
    from .visualize import draw_stage

    layer = bert_layer(64, 4, 128) if args.small else bert_layer()
    compiled = compile_training(layer, bert_layer_inputs(1, args.seq, 64 if args.small else 768), options=options)
    try:
        graph = draw_stage(compiled, args.stage)
    except KeyError as exc:
        raise SystemExit(f"tvmbridge viz: {exc.args[0]}") from None
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    path = graph.render(args.out, format="svg", cleanup=True)
    print(f"{compiled.summary()}\nwrote {path}")


if __name__ == "__main__":
    sys.exit(main())
