"""The model zoo: every registered model trained a few steps through the bridge, judged against
PyTorch (like PyTorch's HF/TIMM benchmark suites), one fresh subprocess per model so that a
crash or a hang of one model does not end the run.

    python scripts/zoo.py                         # all models (30+ minutes on 2 cores)
    python scripts/zoo.py --sample                # the quick sample the default tests run
    python scripts/zoo.py --only bert-mlm,llama   # some models
    python scripts/zoo.py --family timm --json /tmp/zoo.json --markdown /tmp/zoo.md
    python scripts/zoo.py --list
    python scripts/zoo.py --sample --autocast     # eager and TVM under bfloat16 autocast
    python scripts/zoo.py --only wav2vec2-ctc --fallback   # fallback=True: what cannot compile whole, in submodules

Verdicts and the protocol: ``tvmbridge/tools/zoo/harness.py``. The run is with
``CompileOptions.verify`` off (where the option exists): the raw state of the bridge.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tvmbridge.tools.timing import machine_line  # noqa: E402
from tvmbridge.tools.zoo.models import FAMILIES, MODELS, SAMPLE  # noqa: E402

VERDICTS = ("EXACT", "FALLBACK", "REFUSED", "WRONG", "CRASH", "SKIP")
COLUMNS = ("model", "family", "verdict", "reason / worst tensor", "compile s", "variants", "symbolic 2nd",
           "TVM ms", "eager ms", "ratio")


def run_one(name: str, timeout: float, verify: str, timing: bool, log_dir: Path, via: str = "dispatch",
            device: str = "cpu", autocast: bool = False, fallback: bool = False) -> dict:
    """One case in a fresh interpreter; its JSON result, or a CRASH naming how the process ended."""
    out = log_dir / f"{name}.json"
    log = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "tvmbridge.tools.zoo.harness", name, "--json-out", str(out), "--verify", verify,
           "--via", via, "--device", device]
    if not timing:
        cmd.append("--no-timing")
    if autocast:
        cmd.append("--autocast")
    if fallback:
        cmd.append("--fallback")
    start = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the case's own process group, nothing else
            proc.wait()
            rc = None
    wall = round(time.perf_counter() - start, 1)
    if rc == 0 and out.exists():
        return json.loads(out.read_text())
    family = MODELS[name].family
    if rc is None:
        reason = f"timeout: no result after {timeout:.0f} s (hung or too slow)"
    else:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or [""]
        how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
        reason = f"process {how}; last output: {tail[0][:200]}"
    return {"name": name, "family": family, "verdict": "CRASH", "reason": reason, "wall_s": wall,
            "variants": 0, "compile_s": 0.0, "symbolic": None, "tvm_ms": None, "eager_ms": None, "ratio": None}


def _fmt(value: object, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def row(r: dict, width: int | None) -> list[str]:
    """The table's cells for one result (the reason cut to ``width`` characters)."""
    reason = r.get("reason") or ""
    if width is not None and len(reason) > width:
        reason = reason[:width - 3] + "..."
    verdict = r["verdict"]
    return [r["name"], r["family"], verdict, reason, _fmt(r.get("compile_s")), _fmt(r.get("variants")),
            _fmt(r.get("symbolic")), _fmt(r.get("tvm_ms")), _fmt(r.get("eager_ms")), _fmt(r.get("ratio"), 2)]


def totals(results: list[dict]) -> str:
    counts = Counter(r["verdict"] for r in results)
    exact = 100.0 * counts["EXACT"] / len(results) if results else 0.0
    parts = ", ".join(f"{v} {counts[v]}" for v in VERDICTS if counts[v])
    return f"{len(results)} models: {parts}; {exact:.0f}% EXACT"


def text_table(results: list[dict], width: int = 90) -> str:
    rows = [list(COLUMNS)] + [row(r, width) for r in results]
    widths = [max(len(x[i]) for x in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(x, widths)).rstrip() for x in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(results: list[dict], machine: str) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "|".join("---" for _ in COLUMNS) + "|\n"
    body = "".join("| " + " | ".join(c.replace("|", "\\|") for c in row(r, 200)) + " |\n" for r in results)
    return (f"Machine: {machine}\n\n" + head + body + f"\n{totals(results)}\n")


def select(args: argparse.Namespace) -> list[str]:
    if args.sample:
        names = list(SAMPLE)
    elif args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODELS]
        if unknown:
            raise SystemExit(f"unknown model(s) {unknown}; --list names them")
    else:
        names = list(MODELS)
    if args.family:
        names = [n for n in names if MODELS[n].family == args.family]
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--sample", action="store_true", help=f"only the quick sample: {', '.join(SAMPLE)}")
    parser.add_argument("--family", choices=FAMILIES)
    parser.add_argument("--list", action="store_true", help="print the models and exit")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model (default 600)")
    parser.add_argument("--verify", choices=("off", "on", "default"), default="off",
                        help="CompileOptions.verify where the option exists (default off: the raw state)")
    parser.add_argument("--no-timing", action="store_true", help="skip the timed steps")
    parser.add_argument("--via", choices=("dispatch", "backend"), default="dispatch",
                        help="add_tvm_dispatch (default) or torch.compile(model, backend=tvmbridge)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: where models and batches live")
    parser.add_argument("--autocast", action="store_true",
                        help="eager and TVM under bfloat16 autocast, judged against float64 (harness docstring)")
    parser.add_argument("--fallback", action="store_true",
                        help="add_tvm_dispatch(fallback=True): what cannot compile whole runs its submodules on TVM")
    parser.add_argument("--json", help="write all results (and the machine) to this file")
    parser.add_argument("--markdown", help="write the table as markdown (for the README) to this file")
    parser.add_argument("--logs", help="directory for each case's output and result (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.list:
        for entry in MODELS.values():
            print(f"{entry.name:28s} {entry.family:13s} {entry.note}")
        return 0
    names = select(args)
    log_dir = Path(args.logs or tempfile.mkdtemp(prefix="tvmbridge-zoo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_line()
    print(f"{machine}\n{len(names)} models, one subprocess each (timeout {args.timeout:.0f} s); logs in {log_dir}",
          flush=True)
    results: list[dict] = []
    for i, name in enumerate(names, 1):
        result = run_one(name, args.timeout, args.verify, not args.no_timing, log_dir, args.via, args.device,
                         args.autocast, args.fallback)
        results.append(result)
        print(f"[{i}/{len(names)}] {name}: {result['verdict']} ({result.get('wall_s', 0):.0f} s) "
              f"{(result.get('reason') or '')[:160]}", flush=True)
        if args.json:  # after every case: a long run that is stopped keeps what it found
            Path(args.json).write_text(json.dumps({"machine": machine, "verify": args.verify, "via": args.via,
                                                   "device": args.device, "autocast": args.autocast,
                                                   "fallback": args.fallback, "results": results}, indent=1))
    print()
    print(text_table(results))
    print(f"\nCPU: {machine}\n{totals(results)}")
    print("rerun one model: .venv/bin/python scripts/zoo.py --only NAME  (the case alone, in this process: "
          ".venv/bin/python -m tvmbridge.tools.zoo.harness NAME)")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(results, machine))
    bad = sum(r["verdict"] in ("WRONG", "CRASH", "SKIP") for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
