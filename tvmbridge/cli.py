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
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--capture", default="all")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from .demo import run

        run(batch=args.batch, seq=args.seq, steps=args.steps, capture=args.capture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
