"""The OpInfo sweep (``tests/opinfo_sweep.py``) from the command line: every op of PyTorch's
``op_db`` the converter claims, a few samples each, through ``add_tvm_dispatch`` against PyTorch.

    .venv/bin/python scripts/opinfo_sweep.py                 # all claimed ops, 2 samples each
    .venv/bin/python scripts/opinfo_sweep.py --ops clamp,flip --samples 10 -v

Prints ``N/M exact, R refused, W wrong, C crash`` and the refusals grouped by reason; every wrong
and crashed case is listed. Exit status 1 if any case is wrong or crashed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import opinfo_sweep as sw  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", help="comma-separated OpInfo names (name or name.variant); default: all")
    parser.add_argument("--samples", type=int, default=2, help="float64 samples per op (default 2)")
    parser.add_argument("--json", help="write every case here")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case as it ends")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    infos = sw.op_db()
    if args.ops:
        wanted = set(args.ops.split(","))
        infos = [i for i in infos if sw.full_name(i) in wanted or i.name in wanted]
    start = time.perf_counter()

    def show(o: sw.Outcome) -> None:
        if args.verbose or o.kind in ("wrong", "crash"):
            print(f"{o.kind:8s} {o.op} #{o.sample} {o.dtype} {o.reason}", flush=True)

    outcomes = list(sw.sweep(infos, args.samples, show))
    print(f"\n{sw.summary(outcomes)} in {time.perf_counter() - start:.0f} s")
    print("\nrefusals by reason:")
    for reason, ops in sw.refusals_by_reason(outcomes).items():
        print(f"  [{len(ops)}] {reason}\n        {', '.join(ops)}")
    skips = sorted({(o.reason[:100], o.op) for o in outcomes if o.kind == "skip"})
    if skips:
        print(f"\nskipped ({len(skips)} op/reason pairs):")
        for reason, op in skips:
            print(f"  {op}: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return int(any(o.kind in ("wrong", "crash") for o in outcomes))


if __name__ == "__main__":
    sys.exit(main())
