"""One dispatch for a real fine-tuning loop with dynamic padding.

Part 1 (loop): BertForMaskedLM (base config, random weights) trained with AdamW on batches padded
to their longest sequence (lengths drawn from 8..128, skewed short as real text is), its encoder
dispatched with no sample: the first call compiles, later lengths use a symbolic variant. The
same loop runs in eager PyTorch on a copy, step by step in one process (same batches, same seeds):
share of steps on TVM, compiles, compile time, median step times, the largest loss difference.

Part 2 (layer): one BertLayer (base) at a fixed shape: the symbolic variant (compiled at another
length) against a static compile of that shape and eager, interleaved medians.

    python scripts/bench_dynamic.py                        # base config, 100 steps, both parts
    python scripts/bench_dynamic.py --layers 2 --steps 20  # quicker
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from analysis.models import bert_config, bert_layer, bert_layer_inputs  # noqa: E402
from tvmbridge import add_tvm_dispatch  # noqa: E402
from tvmbridge.tools.roofline import roofline_cell, roofline_header, step_flops  # noqa: E402
from tvmbridge.tools.timing import cpu_name, interleaved  # noqa: E402


def batches(steps: int, batch: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Padded MLM batches: lengths ~ 8 + lognormal, clipped to 128; 15% of real tokens are targets."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = (8 + torch.empty(batch).log_normal_(3.2, 0.6, generator=gen)).clamp(8, 128).long()
        seq = int(lengths.max())
        ids = torch.randint(5, vocab, (batch, seq), generator=gen)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        labels = torch.where((torch.rand(batch, seq, generator=gen) < 0.15) & (mask == 1), ids, -100)
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return out


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, data: dict, seed: int) -> tuple[float, float]:
    torch.manual_seed(seed)
    t = time.perf_counter()
    loss = model(**data).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t, float(loss.detach())


def loop(args: argparse.Namespace) -> None:
    from transformers import BertForMaskedLM

    cfg = bert_config(768, args.layers, 12, vocab=args.vocab)
    torch.manual_seed(0)
    eager = BertForMaskedLM(cfg).train()
    tvm = copy.deepcopy(eager)
    add_tvm_dispatch(tvm.bert.encoder)
    d = tvm.bert.encoder._tvm_dispatch
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (eager, tvm)}
    times: dict[str, list[float]] = {"eager": [], "tvm": []}
    compile_steps, worst = [], 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, data in enumerate(batches(args.steps, args.batch, args.vocab)):
            te, le = train_step(eager, opts[eager], data, seed=i)
            n = len(d.variants)
            tt, lt = train_step(tvm, opts[tvm], data, seed=i)
            if len(d.variants) != n:
                compile_steps.append((i, data["input_ids"].shape[1], tt))
            else:
                times["tvm"].append(tt)
                times["eager"].append(te)
            worst = max(worst, abs(le - lt))
    lengths = sorted({b["input_ids"].shape[1] for b in batches(args.steps, args.batch, args.vocab)})
    print(f"\n## loop: BertForMaskedLM ({args.layers} layers, hidden 768), batch {args.batch}, {args.steps} AdamW steps, "
          f"{len(lengths)} distinct padded lengths in {lengths[0]}..{lengths[-1]}")
    total = d.calls_tvm + d.calls_fallback
    print(f"steps on TVM: {d.calls_tvm}/{total} ({100 * d.calls_tvm / max(total, 1):.0f}%), compiles: {len(d.variants)}, "
          f"compile time {sum(v.compiled.compile_seconds['total'] for v in d.variants):.1f}s "
          f"(steps that compiled: {[(i, seq, round(t, 1)) for i, seq, t in compile_steps]})")
    me, mt = statistics.median(times["eager"]), statistics.median(times["tvm"])
    print(f"median step (steps without a compile): eager {me * 1e3:.0f} ms, TVM {mt * 1e3:.0f} ms, ratio {mt / me:.2f}x")
    print(f"largest |loss difference| over the steps: {worst:.2e}")
    print(f"warnings: {sorted({str(w.message)[:100] for w in caught})}")
    print(d.explain())


def layer(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    eager = bert_layer()
    static, symbolic = copy.deepcopy(eager), copy.deepcopy(eager)
    x, mask = bert_layer_inputs(args.batch, args.seq)
    add_tvm_dispatch(static, (x, mask), dynamic=False)
    other = bert_layer_inputs(args.batch, args.seq // 2)
    add_tvm_dispatch(symbolic, other, dynamic={"hidden_states": {1: "seq"}, "attention_mask": {3: "seq"}})
    assert symbolic._tvm_dispatch.variants[0].symbolic

    def step(m):
        def run(i: int) -> None:
            torch.manual_seed(i)
            m(x.detach().requires_grad_(), mask).sum().backward()
        return run

    flops = step_flops(lambda: step(eager)(0))
    t = interleaved({"eager": step(eager), "static": step(static), "symbolic": step(symbolic)}, args.runs, 3)
    med = {k: statistics.median(v) for k, v in t.items()}
    print(f"\n## layer: BertLayer (8 x 128 x 768 at defaults) ({args.batch},{args.seq}), {args.runs} interleaved rounds")
    print(roofline_header((torch.float32,)))
    for k, v in med.items():
        print(f"{k:9s} {v * 1e3:8.1f} ms   {v / med['eager']:.2f}x eager   {v / med['static']:.2f}x static   "
              f"{roofline_cell(flops, v)}")
    assert symbolic._tvm_dispatch.calls_tvm == args.runs + 3 and static._tvm_dispatch.calls_tvm == args.runs + 3
    print(f"compile: static {static._tvm_dispatch.variants[0].compiled.compile_seconds['total']:.1f}s, "
          f"symbolic {symbolic._tvm_dispatch.variants[0].compiled.compile_seconds['total']:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("loop", "layer", "both"), default="both")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128, help="layer part: the fixed length")
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--runs", type=int, default=10, help="layer part: timed rounds")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    if args.part in ("loop", "both"):
        loop(args)
    if args.part in ("layer", "both"):
        layer(args)


if __name__ == "__main__":
    main()
