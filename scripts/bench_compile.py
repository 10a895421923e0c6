"""Where a compile's seconds go, cold and with the disk cache: one table row per model and run.

Each run is a fresh interpreter (what a user restarting a training job pays): ``cold`` with an
empty cache directory, then ``warm``, a second process over the directory the cold one filled
(the executable loaded instead of built). Per stage: the pipeline's own timings
(``CompileResult.compile_seconds``); ``import`` is torch, transformers and the bridge loading,
``first compile`` the whole ``compile_training`` call (the training part: forward and backward),
``process`` from interpreter start to the compile's end, and the inference part (the no_grad
forward) as the first no_grad call would build it after (or load it, warm). The GEMM choices are measured once before the runs (they are kept per machine,
not per model), so neither run pays them.

    python scripts/bench_compile.py                                  # BertLayer base, BERT-MLM base
    python scripts/bench_compile.py --models bert-layer,zoo:gpt2,zoo:resnet --out bench_results/compile
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGE_GROUPS = {  # the table's columns: pipeline stages, grouped
    "trace": ("inputs", "trace"),
    "convert+passes": ("convert", "random", "layer_norm", "dedup"),
    "gradient+split": ("gradient", "simplify", "capture", "split"),
    "offload": ("offload", "convolutions"),
    "lower+LLVM": ("low_precision", "fast_math", "build"),
}


def build_case(name: str, batch: int, seq: int) -> tuple:
    """(module, args, kwargs) in train mode."""
    import torch

    if name == "bert-layer":
        from analysis.models import bert_layer, bert_layer_inputs

        return bert_layer(), bert_layer_inputs(batch, seq, 768, generator=torch.Generator().manual_seed(0)), {}
    if name == "bert-mlm-base":
        from transformers import BertForMaskedLM

        from analysis.models import bert_config

        ids = torch.randint(0, 30522, (batch, seq), generator=torch.Generator().manual_seed(0))
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        return BertForMaskedLM(bert_config()).train(), (), kwargs
    if name.startswith("zoo:"):
        from tvmbridge.tools.zoo.models import get

        entry = get(name[4:])
        torch.manual_seed(0)
        batch = dict(entry.make_batch(2, 16, 0))
        if entry.external_loss:  # the model takes the images; the loss is taken outside it
            return entry.build().train(), (batch["x"],), {}
        return entry.build().train(), (), batch
    raise SystemExit(f"unknown model {name!r}: bert-layer, bert-mlm-base or zoo:NAME")


def child(name: str, batch: int, seq: int) -> None:
    """One compile in this process; prints a JSON line of its timings."""
    import torch  # noqa: F401

    from tvmbridge.pipeline.parts import INFER
    from tvmbridge.runtime.compiled import compile_training

    imported = time.perf_counter()
    module, args, kwargs = build_case(name, batch, seq)
    t = time.perf_counter()
    compiled = compile_training(module, args, kwargs, verify=False)
    done = time.perf_counter()
    compiled.parts.get(INFER)  # what the first no_grad call would build (or load) later
    print("RESULT " + json.dumps({
        "stages": compiled.compile_seconds, "loaded": compiled.executable_loaded,
        "import": imported - START, "first compile": done - t, "process": done - START,
        "infer part": compiled.parts.seconds[INFER],
    }))


def run(name: str, batch: int, seq: int, cache: str) -> dict:
    env = {**os.environ, "TVMBRIDGE_CACHE_DIR": cache, "TVMBRIDGE_DISK_CACHE": "1"}
    cmd = [sys.executable, __file__, "--child", name, "--batch", str(batch), "--seq", str(seq)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{name}: the child failed\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def share_gemm_choices(source: str, target: str) -> None:
    choices = Path(source) / "gemm_choices.json"
    if choices.is_file():
        (Path(target) / "gemm_choices.json").write_bytes(choices.read_bytes())


def markdown(rows: list[dict], machine: str) -> str:
    cols = ["model", "run", *STAGE_GROUPS, "pipeline total", "first compile", "import", "process",
            "inference part, at the first no_grad call"]
    out = [f"Compile time, fresh processes ({machine})", "", "| " + " | ".join(cols) + " |",
           "|" + "---|" * len(cols)]
    for r in rows:
        s = r["stages"]
        groups = [sum(s.get(k, 0.0) for k in ks) for ks in STAGE_GROUPS.values()]
        cells = [r["model"], r["run"] + (" (loaded)" if r["loaded"] else ""), *(f"{g:.2f}" for g in groups),
                 f"{s.get('total', 0):.2f}", f"{r['first compile']:.2f}", f"{r['import']:.2f}",
                 f"{r['process']:.2f}", f"{r['infer part']:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bert-layer,bert-mlm-base")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default="bench_results/bench_compile")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.batch, args.seq)
        return
    from tvmbridge.tools.timing import machine_line, write_results

    machine = machine_line()
    rows = []
    with tempfile.TemporaryDirectory() as warmup:
        for name in args.models.split(","):
            run(name, args.batch, args.seq, warmup)  # GEMM choices measured, kept in `warmup`
            with tempfile.TemporaryDirectory() as cache:
                share_gemm_choices(warmup, cache)
                for label in ("cold", "warm"):
                    row = {"model": name, "run": label, **run(name, args.batch, args.seq, cache)}
                    print(f"{name} {label}: {row['first compile']:.2f} s", flush=True)
                    rows.append(row)
    write_results(args.out, machine, rows, markdown(rows, machine))


if __name__ == "__main__":
    main()
