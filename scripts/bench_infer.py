"""BERT-base inference (BertModel, random weights, eval mode): TVM (compile_inference) vs PyTorch
eager vs torch.compile, in one process, interleaved medians, ratios to eager.

    python scripts/bench_infer.py                       # (1,14) and (8,128)
    python scripts/bench_infer.py --shapes 1x14 --no-compile
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tvmbridge import compile_inference  # noqa: E402
from tvmbridge.backend.gemm_choice import summary  # noqa: E402
from tvmbridge.tools.roofline import roofline_cell, roofline_header, step_flops  # noqa: E402
from tvmbridge.tools.timing import interleaved, machine_line, write_results  # noqa: E402


def bench_shape(model: torch.nn.Module, batch: int, seq: int, args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[batch // 2:, seq * 3 // 4:] = 0  # some padding
    t = time.perf_counter()
    tvm_fn = compile_inference(model, (ids, mask))
    compile_s = time.perf_counter() - t
    with torch.no_grad():
        want = model(ids, mask).last_hidden_state
    err = (tvm_fn(ids, mask).last_hidden_state - want).abs().max().item()
    calls = {"tvm": lambda i: tvm_fn(ids, mask), "eager": lambda i: model(ids, mask)}
    if not args.no_compile:
        compiled = torch.compile(model)
        with torch.no_grad():
            compiled(ids, mask)
        calls["compile"] = lambda i: compiled(ids, mask)
    with torch.no_grad():
        times = interleaved(calls, args.runs, args.warmup)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    with torch.no_grad():
        flops = step_flops(lambda: model(ids, mask))
    row = {"shape": f"({batch},{seq})", "ms": ms, "flops": flops, "compile_s": compile_s, "max_abs_err": err,
           "gemms": summary(list(tvm_fn.gemm_choices))}
    print(f"({batch},{seq}), {flops / 1e9:.2f} GFLOP: "
          + ", ".join(f"{k} {v:.2f} ms ({v / ms['eager']:.2f}x, {roofline_cell(flops, v / 1e3)})" for k, v in ms.items())
          + f"; compile {compile_s:.1f} s; max |err| {err:.1e}; GEMMs {row['gemms']}", flush=True)
    return row


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x14,8x128")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--out", default="bench_results/bench_infer")
    args = ap.parse_args()
    machine = machine_line()
    print(machine, "\n" + roofline_header((torch.float32,)), flush=True)
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
    rows = [bench_shape(model, *(int(v) for v in s.split("x")), args) for s in args.shapes.split(",")]
    lines = [f"Machine: {machine}", roofline_header((torch.float32,)), "",
             "| shape | GFLOP | TVM ms (rate) | eager ms (rate) | torch.compile ms | TVM/eager | compile s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, flops = r["ms"], r["flops"]
        comp = f"{ms['compile']:.2f}" if "compile" in ms else "-"
        lines.append(f"| {r['shape']} | {flops / 1e9:.2f} | {ms['tvm']:.2f} ({roofline_cell(flops, ms['tvm'] / 1e3)}) | "
                     f"{ms['eager']:.2f} ({roofline_cell(flops, ms['eager'] / 1e3)}) | {comp} | "
                     f"{ms['tvm'] / ms['eager']:.2f}x | {r['compile_s']:.1f} |")
    text = "\n".join(lines)
    write_results(args.out, machine, rows, text)


if __name__ == "__main__":
    main()
