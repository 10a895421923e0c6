"""Whole transformers models trained through TVM from their ordinary call, loss included.

Per model (``tvmbridge.tools.whole_models``: BertForMaskedLM, GPT2LMHeadModel,
ViTForImageClassification, ResNetForImageClassification; random weights, base configs by
default): compile time, the train step (forward, loss, backward) of TVM against PyTorch eager in
one run (interleaved medians), bytes kept for the backward against PyTorch's saved bytes, and the
losses of AdamW steps from the same start on both (the largest difference, and the curve).

    python scripts/bench_models.py                                  # all four, base, (8,128)
    python scripts/bench_models.py --models bert-mlm --size small   # quick

With --autocast every step runs under torch.autocast(bfloat16) (float32 master weights), and the
loss curves come in three: TVM autocast, eager autocast and eager float32. TVM's curve is within
noise of eager autocast's when its distance to it is no larger than autocast's own distance to
float32 (the "noise" mixed precision brings in the first place).

    python scripts/bench_models.py --autocast --models bert-mlm --size small --steps 200
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tvmbridge import add_tvm_dispatch  # noqa: E402
from tvmbridge.tools.roofline import measure_peak, roofline_cell, roofline_header, step_flops  # noqa: E402
from tvmbridge.tools.timing import interleaved, machine_line, write_results  # noqa: E402
from tvmbridge.tools.whole_models import WHOLE_MODELS, TrainingTask, build_task  # noqa: E402


def autocast(on: bool) -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def train_step(task: TrainingTask, model: torch.nn.Module, mixed: bool = False):
    def step(i: int) -> None:
        torch.manual_seed(i)
        with autocast(mixed):
            loss = task.call(model).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def adamw_losses(task: TrainingTask, model: torch.nn.Module, steps: int, mixed: bool = False) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for i in range(steps):
        torch.manual_seed(1000 + i)
        with autocast(mixed):
            loss = task.call(model).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def bench_model(name: str, args: argparse.Namespace) -> dict:
    batch = args.batch if name.endswith("lm") else args.image_batch
    task = build_task(name, args.size, batch=batch, seq=args.seq)
    eager = copy.deepcopy(task.model)
    mixed = args.autocast
    t = time.perf_counter()
    with autocast(mixed):
        add_tvm_dispatch(task.model, task.args, task.kwargs)
    compile_s = time.perf_counter() - t
    dispatch = task.model._tvm_dispatch
    report = dispatch.report() if not mixed else None
    print(f"{name}: compiled in {compile_s:.1f} s{' under autocast(bfloat16)' if mixed else ''}", flush=True)
    flops = step_flops(lambda: train_step(task, eager)(0))  # forward, loss and backward, on the eager model
    steps = {"tvm": train_step(task, task.model, mixed), "eager": train_step(task, eager, mixed)}
    if mixed:
        steps["eager float32"] = train_step(task, eager)
    times = interleaved(steps, args.runs, args.warmup)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    dtype = torch.bfloat16 if mixed else torch.float32
    print(f"  train step ({flops / 1e9:.1f} GFLOP): TVM {ms['tvm']:.1f} ms = {roofline_cell(flops, ms['tvm'] / 1e3, dtype)}, "
          f"eager {ms['eager']:.1f} ms = {roofline_cell(flops, ms['eager'] / 1e3, dtype)} ({ms['tvm'] / ms['eager']:.2f}x)"
          + (f", eager float32 {ms['eager float32']:.1f} ms" if mixed else ""), flush=True)
    start = copy.deepcopy(eager)  # every curve from the same weights (timing changed no weights, BN stats alike)
    tvm_model = task.model
    tvm_model.load_state_dict(start.state_dict())
    curves = {"tvm": adamw_losses(task, tvm_model, args.steps, mixed),
              "eager": adamw_losses(task, copy.deepcopy(start), args.steps, mixed)}
    if mixed:
        curves["eager float32"] = adamw_losses(task, start, args.steps)
    diff = max(abs(a - b) for a, b in zip(curves["tvm"], curves["eager"]))
    print(f"  {args.steps} AdamW steps: loss {curves['eager'][0]:.4f} -> {curves['eager'][-1]:.4f}, "
          f"largest TVM-eager difference {diff:.2e}", flush=True)
    if mixed:
        noise = max(abs(a - b) for a, b in zip(curves["eager"], curves["eager float32"]))
        print(f"  largest eager autocast - eager float32 difference (autocast's own noise) {noise:.2e}: "
              f"TVM {'within' if diff <= noise else 'OUTSIDE'} noise", flush=True)
    assert dispatch.calls_fallback == 0, dispatch.explain()
    return {"model": name, "type": type(eager).__name__, "inputs": describe_inputs(task), "compile_s": compile_s,
            "autocast": mixed, "flops": flops, "tvm_ms": ms["tvm"], "eager_ms": ms["eager"],
            "eager_float32_ms": ms.get("eager float32"),
            "tvm_kept_bytes": report.tvm_bytes if report else 0,
            "pytorch_saved_bytes": report.pytorch_saved_bytes if report else 0, "calls_tvm": dispatch.calls_tvm,
            "calls_torch": dispatch.calls_fallback, "losses": curves, "max_loss_diff": diff}


def describe_inputs(task: TrainingTask) -> str:
    tensors = [*task.args, *task.kwargs.values()]
    return ", ".join(str(tuple(t.shape)) for t in tensors if isinstance(t, torch.Tensor))


def markdown(rows: list[dict], machine: str) -> str:
    mib = 2**20
    out = [f"Machine: {machine}", roofline_header(), "",
           "| model | inputs | GFLOP | compile s | TVM step ms (of peak) | eager ms (of peak) | TVM/eager | "
           "kept for backward MiB | PyTorch saved MiB | AdamW loss diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dtype = torch.bfloat16 if r["autocast"] else torch.float32
        share = {k: f"{measure_peak(dtype).fraction(r['flops'], r[k] / 1e3):.0%}" for k in ("tvm_ms", "eager_ms")}
        out.append(f"| {r['type']} | {r['inputs']} | {r['flops'] / 1e9:.1f} | {r['compile_s']:.1f} | "
                   f"{r['tvm_ms']:.1f} ({share['tvm_ms']}) | {r['eager_ms']:.1f} ({share['eager_ms']}) | "
                   f"{r['tvm_ms'] / r['eager_ms']:.2f}x | {r['tvm_kept_bytes'] / mib:.1f} | "
                   f"{r['pytorch_saved_bytes'] / mib:.1f} | {r['max_loss_diff']:.1e} |")
    for r in rows:
        if r["autocast"]:
            ac = r["losses"]["eager"]
            noise = max(abs(a - b) for a, b in zip(ac, r["losses"]["eager float32"]))
            out += ["", f"{r['type']} under autocast(bfloat16): eager float32 step {r['eager_float32_ms']:.1f} ms; "
                    f"{len(ac)} AdamW steps, loss {ac[0]:.4f} -> {ac[-1]:.4f}; largest TVM - eager autocast loss "
                    f"difference {r['max_loss_diff']:.2e}, eager autocast - eager float32 {noise:.2e}"]
        pairs = ", ".join(f"{a:.4f}/{b:.4f}" for a, b in zip(r["losses"]["tvm"], r["losses"]["eager"]))
        out += ["", f"{r['type']} AdamW losses (TVM/eager): {pairs}"]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(WHOLE_MODELS))
    ap.add_argument("--size", default="base", choices=("small", "base"))
    ap.add_argument("--batch", type=int, default=8, help="batch of the language models")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--image-batch", type=int, default=8, help="batch of ViT and ResNet (224x224 at base)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="AdamW steps of the loss curves")
    ap.add_argument("--autocast", action="store_true", help="every step under torch.autocast(bfloat16), see above")
    ap.add_argument("--out", default="bench_results/bench_models")
    args = ap.parse_args()
    machine = machine_line()
    print(machine, "\n" + roofline_header(), flush=True)
    rows = [bench_model(name, args) for name in args.models.split(",")]
    text = markdown(rows, machine)
    write_results(args.out, machine, rows, text)


if __name__ == "__main__":
    main()
