"""What the first-call safety net (``verify=True``, the default) costs: a variant's checked first
step (PyTorch's forward run too, its graph kept until the first backward, every gradient
compared) next to the same step unchecked and to eager, and the PyTorch allocator's peak of
each (TVM's own pool is the same in both, so the difference is the net's).

The checked step is repeated by resetting the variant's trust; medians of interleaved runs.

    python scripts/bench_verify.py                       # BertLayer base (8,128), BERT-MLM small (8,128)
    python scripts/bench_verify.py --runs 5 --out bench_results/verify
"""
from __future__ import annotations

import argparse
import copy
import statistics
import warnings
from typing import Any, Callable

import torch

from analysis.memory.allocator import allocator_peak
from analysis.models import bert_layer, bert_layer_inputs
from tvmbridge import add_tvm_dispatch
from tvmbridge.runtime.verify import Trust
from tvmbridge.tools.timing import interleaved, machine_line, write_results


def _bert_mlm(batch: int, seq: int) -> tuple[torch.nn.Module, dict]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8000, (batch, seq), generator=g)
    return BertForMaskedLM(cfg).train(), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _cases(batch: int, seq: int) -> dict[str, tuple[torch.nn.Module, tuple, dict]]:
    x, mask = bert_layer_inputs(batch, seq, 768, torch.float32, generator=torch.Generator().manual_seed(3))
    mlm, kwargs = _bert_mlm(batch, seq)
    return {f"BertLayer base ({batch},{seq})": (bert_layer(), (x, mask), {}),
            f"BERT-MLM hidden 256 x4 ({batch},{seq})": (mlm, (), kwargs)}


def _step(model: torch.nn.Module, args: tuple, kwargs: dict) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = model(*args, **kwargs)
        loss = out.loss if hasattr(out, "loss") else out.float().pow(2).mean()
        loss.backward()
    return run


def _untrusted(model: torch.nn.Module, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` on a variant that has not been checked yet (its first call, again and again)."""
    def run() -> None:
        for variant in model._tvm_dispatch.variants:
            variant.trust = Trust()
        step()
    return run


def measure(name: str, model: torch.nn.Module, args: tuple, kwargs: dict, runs: int) -> dict[str, Any]:
    eager = copy.deepcopy(model)
    checked = add_tvm_dispatch(copy.deepcopy(model), args, kwargs)
    plain = add_tvm_dispatch(copy.deepcopy(model), args, kwargs, verify=False)
    steps = {"checked first step": _untrusted(checked, _step(checked, args, kwargs)),
             "compiled step": _step(plain, args, kwargs), "eager step": _step(eager, args, kwargs)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a discarded variant would make the figures meaningless
        times = {k: statistics.median(v) for k, v in interleaved(
            {k: (lambda i, f=f: f()) for k, f in steps.items()}, runs, warmup=1).items()}
        peaks = {k: allocator_peak(f, baseline=0).peak for k, f in steps.items()}
    return {"case": name, **{f"{k} ms": 1e3 * t for k, t in times.items()},
            **{f"{k} peak MiB": p / 2**20 for k, p in peaks.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="bench_results/verify")
    a = parser.parse_args()
    machine = machine_line()
    rows = [measure(name, *case, a.runs) for name, case in _cases(a.batch, a.seq).items()]
    lines = [f"First-call verification cost, {machine}, medians of {a.runs} interleaved runs", "",
             "| case | checked first step | compiled step | eager step | checked / compiled | "
             "PyTorch peak: checked | compiled | eager |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['checked first step ms']:.1f} ms | {r['compiled step ms']:.1f} ms | "
                     f"{r['eager step ms']:.1f} ms | {r['checked first step ms'] / r['compiled step ms']:.2f}x | "
                     f"{r['checked first step peak MiB']:.0f} MiB | {r['compiled step peak MiB']:.0f} MiB | "
                     f"{r['eager step peak MiB']:.0f} MiB |")
    write_results(a.out, machine, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
