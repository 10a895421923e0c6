"""``python -m analysis profile <model>``: trace and profile a built-in model, print the table."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from analysis.models import MODELS, sizes_accepted


def _profile(args: argparse.Namespace) -> int:
    import torch

    from analysis.profiling.meta import MetaTensorMode
    from analysis.profiling.profile import symbolic_profile
    from analysis.profiling.table import profile_table
    from analysis.profiling.trace import symbolic_trace

    logging.getLogger("transformers").setLevel(logging.ERROR)
    sizes = {"batch": args.batch, "seq": args.seq, "size": args.size, "layers": args.layers}
    kw = sizes_accepted(args.model, {k: v for k, v in sizes.items() if v is not None})
    t0 = time.perf_counter()
    with MetaTensorMode():  # no real memory: the model and its input are fake
        model, meta_args = MODELS[args.model](**kw)
    t1 = time.perf_counter()
    try:
        gm = symbolic_trace(model, meta_args)
        t2 = time.perf_counter()
        symbolic_profile(gm, *meta_args.values())
    except Exception as exc:  # noqa: BLE001 - report what failed, without a traceback
        print(f"python -m analysis: could not profile {args.model}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    t3 = time.perf_counter()
    print(profile_table(gm, skip_empty=not args.all))
    print(
        f"{args.model}: build {t1 - t0:.2f} s, trace {t2 - t1:.2f} s, profile {t3 - t2:.2f} s "
        f"({len(gm.graph.nodes)} nodes); torch {torch.__version__}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("profile", help="profile a built-in model (fake tensors, nothing runs)")
    pp.add_argument("model", choices=sorted(MODELS))
    pp.add_argument("--batch", type=int, default=8)
    pp.add_argument("--seq", type=int, default=None, help="sequence length (language models; default 128)")
    pp.add_argument("--size", type=int, default=None, help="image size (cnn: 32, resnet18 and vit-s6: 224)")
    pp.add_argument("--layers", type=int, default=None, help="layers (bert-encoder; default 12)")
    pp.add_argument("--all", action="store_true", help="also list nodes that cost nothing")
    args = p.parse_args(argv)
    if args.cmd == "profile":
        return _profile(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
