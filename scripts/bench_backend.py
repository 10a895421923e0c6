"""The torch.compile backend beside eager, inductor and ``add_tvm_dispatch``, in one run.

Per model: the first training step (the compile, and for the bridge its checked first call), the
steady step (median of interleaved runs), and a dynamic-padding loop (a new length every batch):
its wall time and how many compiles it caused. A tiny model's step shows the per-call overhead
(guards, argument handling) each path adds to eager's.

    python scripts/bench_backend.py                    # BertLayer base, BERT-MLM small (8,128)
    python scripts/bench_backend.py --runs 5 --out bench_results/backend
    python scripts/bench_backend.py --no-inductor      # where no C++ compiler is at hand
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any, Callable

import torch

from analysis.models import bert_layer, bert_layer_inputs
from tvmbridge import add_tvm_dispatch, compile_backend
from tvmbridge.tools.roofline import measure_peak, roofline_header, step_flops
from tvmbridge.tools.timing import interleaved, machine_line, write_results


def _bert_mlm(batch: int, seq: int) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024)

    def batch_of(length: int) -> dict:
        ids = torch.randint(0, 8000, (batch, length), generator=torch.Generator().manual_seed(length))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    torch.manual_seed(0)
    return BertForMaskedLM(cfg).train(), batch_of


def _bert_layer(batch: int, seq: int) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    def batch_of(length: int) -> dict:
        x, mask = bert_layer_inputs(batch, length, 768, torch.float32, generator=torch.Generator().manual_seed(3))
        return {"hidden_states": x, "attention_mask": mask}
    torch.manual_seed(0)
    return bert_layer().train(), batch_of


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def _tiny(batch: int, seq: int) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    torch.manual_seed(0)
    return _Tiny().train(), lambda length: {"x": torch.randn(length // 32 or 1, 8)}


def _paths(model: torch.nn.Module, inductor: bool) -> dict[str, tuple[torch.nn.Module, Callable, Any]]:
    """name -> (the model copy its optimizer steps, what to call, what counts its compiles)."""
    paths = {"eager": (model, model, None)}
    if inductor:
        m = copy.deepcopy(model)
        paths["inductor"] = (m, torch.compile(m), "dynamo")
    m = copy.deepcopy(model)
    backend = compile_backend()
    paths["backend=tvmbridge"] = (m, torch.compile(m, backend=backend), backend)
    m = copy.deepcopy(model)
    paths["add_tvm_dispatch"] = (m, add_tvm_dispatch(m), "dispatch")
    return paths


def _compiles(counter: Any, model: torch.nn.Module) -> int | None:
    """Compiles so far: the bridge's variants (per graph for the backend), dynamo's graphs for inductor."""
    if counter is None:
        return None
    if counter == "dispatch":
        return len(model._tvm_dispatch.variants)
    if counter == "dynamo":
        return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return sum(len(g.dispatcher.variants) for g in counter.graphs)


def _step(model: torch.nn.Module, call: Callable, opt: torch.optim.Optimizer, batch: dict) -> Callable[[int], None]:
    def run(i: int) -> None:
        torch.manual_seed(i)
        out = call(**batch)
        loss = out.loss if hasattr(out, "loss") else out[0].float().pow(2).mean() if isinstance(out, tuple) \
            else out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def bench(name: str, make: Callable, batch: int, seq: int, lengths: list[int], runs: int,
          inductor: bool) -> list[dict]:
    torch._dynamo.reset()
    model, batch_of = make(batch, seq)
    paths = _paths(model, inductor)
    eager_model, eager_call, _ = paths["eager"]
    flops = step_flops(lambda: _step(eager_model, eager_call, torch.optim.SGD(eager_model.parameters(), lr=0.0),
                                     batch_of(seq))(0))
    steps, rows = {}, {}
    for path, (m, call, counter) in paths.items():
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)
        steps[path] = _step(m, call, opt, batch_of(seq))
        t = time.perf_counter()
        steps[path](0)  # the compile (and the bridge's checked first call)
        rows[path] = {"model": name, "path": path, "first_step_s": round(time.perf_counter() - t, 2)}
    times = interleaved(steps, runs=runs, warmup=1)
    eager_ms = 1e3 * statistics.median(times["eager"])
    for path, (m, call, counter) in paths.items():
        ms = 1e3 * statistics.median(times[path])
        before = _compiles(counter, m)
        opt = torch.optim.SGD(m.parameters(), lr=1e-4)
        t = time.perf_counter()
        for length in lengths:
            _step(m, call, opt, batch_of(length))(0)
        loop = time.perf_counter() - t
        after = _compiles(counter, m)
        rows[path].update(step_ms=round(ms, 2), vs_eager=round(ms / eager_ms, 2), loop_s=round(loop, 2),
                          gflop=round(flops / 1e9, 3), of_peak=round(measure_peak().fraction(flops, ms / 1e3), 3),
                          loop_compiles=None if after is None else after - before)
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--out", default="bench_results/backend")
    args = parser.parse_args()
    machine = machine_line()
    lengths = [96, 112, 100, 120, 104, 128]
    cases = [("BertLayer base", _bert_layer), ("BERT-MLM hidden 256 x4", _bert_mlm), ("Linear 8x8 (overhead)", _tiny)]
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, make in cases:
            seq = args.seq
            rows += bench(name, make, args.batch, seq, lengths, args.runs, not args.no_inductor)
    lines = [f"Machine: {machine}. Training step (forward, loss, backward, SGD), batch {args.batch}, length "
             f"{args.seq}; median of {args.runs} interleaved runs. Dynamic loop: lengths {lengths}, one step each.",
             roofline_header((torch.float32,)), "",
             "| model | path | first step (s) | step (ms) | of float32 peak | vs eager | dynamic loop (s) | compiles in loop |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        compiles = "" if r["loop_compiles"] is None else r["loop_compiles"]
        lines.append(f"| {r['model']} | {r['path']} | {r['first_step_s']} | {r['step_ms']} | {r['of_peak']:.0%} | "
                     f"{r['vs_eager']} | {r['loop_s']} | {compiles} |")
    write_results(args.out, machine, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
