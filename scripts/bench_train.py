"""One training step (forward + backward, dropout on) of a BertLayer: TVM dispatch vs PyTorch.

Same process, same inputs; medians over --runs steps after --warmup, as ratios to PyTorch eager.
Variants per shape:
  tvm           the default: min-cut capture set, dense matmuls offloaded (offload_matmul="auto":
                each distinct GEMM on the library measured fastest on this machine, cached)
  tvm-torch-gemm  every offloaded matmul on torch.matmul (MKL on x86), as eager PyTorch runs them
  tvm-torch-masks  dropout masks drawn by ATen's serial bernoulli_ instead of the vectorized
                kernel (tvmbridge/kernels/mt19937.py; same masks)
  tvm-all       capture="all" (keep everything the backward reads)
  tvm-no-fast-math  libm erf/exp/tanh instead of the float32 fast kernels
  tvm-no-cpu-schedules  TVM's own kernels left as serial loops
  tvm-no-fusion  one TVM kernel per Relax op (no FuseOps/FuseTIR)
  tvm-fp-contract  TVM's CPU kernels with FMA contraction (fp_contract=True; the default rounds as eager)
  tvm-no-offload  TVM's own (untuned) matmul kernels; only for --no-offload-shapes (very slow)
  tvm-tuned     the default with --tuning-db (a MetaSchedule database), when given
  eager         PyTorch eager
  compile       torch.compile (inductor), unless --no-compile
Also: compile times, bytes kept for the backward per capture policy next to PyTorch's saved bytes,
forward-only inference time, and a per-kernel breakdown of the default TVM step (VM instrument).
Writes JSON and a markdown table (--out).

With --autocast (mixed precision, bfloat16 on CPU): the BertLayer and BertForMaskedLM (base)
steps under torch.autocast, TVM vs eager autocast vs torch.compile autocast vs eager float32,
with the CPU's bfloat16 ISA support named (which path the low-precision GEMMs take).

    python scripts/bench_train.py                     # shapes (1,14) and (8,128)
    python scripts/bench_train.py --shapes 1x14 --runs 30 --no-compile
    python scripts/bench_train.py --autocast --shapes 8x128,32x128 --runs 10
"""
from __future__ import annotations

import argparse
import collections
import copy
import statistics
import time
from typing import Callable

import torch

from analysis.models import bert_layer, bert_layer_inputs
from tvmbridge import CompileOptions, add_tvm_dispatch
from tvmbridge.tools.roofline import roofline_cell, roofline_header, step_flops
from tvmbridge.tools.timing import interleaved, machine_line, write_results


def timed(step: Callable[[int], None], runs: int, warmup: int) -> list[float]:
    return interleaved({"_": step}, runs, warmup)["_"]


def train_step(module, x, mask) -> Callable[[int], None]:
    params = list(module.parameters())

    def step(i: int) -> None:
        torch.manual_seed(i)
        xi = x.detach().requires_grad_()
        module(xi, mask).sum().backward()
        for p in params:
            p.grad = None

    return step


def infer_step(module, x, mask) -> Callable[[int], None]:
    def step(i: int) -> None:
        with torch.no_grad():
            module(x, mask)

    return step


def kernel_breakdown(layer, x, mask, steps: int = 5, top: int = 10) -> list[tuple[str, float]]:
    """Per-kernel time of the TVM step (ms per step), from the VM's instrument hook."""
    compiled = layer._tvm_dispatch.compiled
    acc: dict[str, float] = collections.defaultdict(float)
    start: dict[str, float] = {}

    def instrument(func, name, before, ret, *args):
        if before:
            start[name] = time.perf_counter()
        else:
            acc[name] += time.perf_counter() - start.pop(name)
        return 0

    compiled.set_instrument(instrument)
    try:
        step = train_step(layer, x, mask)
        for i in range(steps):
            step(i)
    finally:
        compiled.set_instrument(None)
    rows = sorted(((k, v / steps * 1e3) for k, v in acc.items()), key=lambda kv: -kv[1])
    return rows[:top] + [("(all kernels)", sum(v for _, v in rows))]


def gemm_table(layer, runs: int = 10) -> list[dict]:
    """Each distinct offloaded GEMM of the compiled step (forward and backward), timed alone on
    both backends through the same packed functions the VM calls: which library wins where."""
    import dataclasses

    import tvm_ffi

    from tvmbridge.backend.offload import offloaded_gemms
    from tvmbridge.kernels.gemm import LIBRARIES, onednn_available, onednn_fits

    built = layer._tvm_dispatch.compiled.stages["fast_math"]
    seen: dict[tuple, int] = collections.Counter()
    chosen: dict[tuple, str] = {}
    for func in ("forward", "backward"):
        for spec, shapes in offloaded_gemms(built[func]):
            # an addmm counts as its GEMM (the bias operand dropped): the libraries are compared on the product
            key = (dataclasses.replace(spec, library="torch", bias=False), tuple(map(tuple, shapes[:2])))
            seen[key] += 1
            chosen[key] = spec.library
    rows = []
    for (spec, shapes), count in seen.items():
        ops = [tvm_ffi.from_dlpack(torch.randn(*s)) for s in shapes]
        gflop = spec.flops(shapes[0], shapes[1]) / 1e9
        row = {"gemm": spec.kind, "shapes": shapes, "per_step": count, "GFLOP": gflop,
               "chosen": chosen[(spec, shapes)]}
        for library in LIBRARIES:
            if library == "onednn" and not (onednn_available() and onednn_fits("float32", *shapes[:2], spec.trans_a)):
                continue
            f = tvm_ffi.get_global_func(dataclasses.replace(spec, library=library).name)
            ts = timed(lambda i: f(*ops), runs, 2)
            row[f"{library}_ms"] = statistics.median(ts) * 1e3
            row[f"{library}_GFLOPs"] = gflop / statistics.median(ts)
        rows.append(row)
    return rows


def bench_shape(batch: int, seq: int, args) -> dict:
    torch.manual_seed(0)
    base = bert_layer()
    x, mask = bert_layer_inputs(batch, seq)
    res: dict = {"shape": f"({batch},{seq},768)", "train_ms": {}, "infer_ms": {}, "compile_s": {}, "bytes": {}}
    default = CompileOptions()
    variants = {
        "tvm": default, "tvm-torch-gemm": default.replace(offload_matmul="torch"),
        "tvm-torch-masks": default.replace(mask_kernel=False), "tvm-all": default.replace(capture="all"),
        "tvm-no-fast-math": default.replace(fast_math=False), "tvm-no-cpu-schedules": default.replace(cpu_schedules=False),
        "tvm-no-fusion": default.replace(fuse=False), "tvm-fp-contract": default.replace(fp_contract=True),
    }
    if args.tuning_db:
        variants["tvm-tuned"] = default.replace(tuning_db=args.tuning_db)
    if f"{batch}x{seq}" in args.no_offload_shapes.split(","):
        variants["tvm-no-offload"] = default.replace(offload_matmul=False)
    layers = {}
    for name, opts in variants.items():
        m = copy.deepcopy(base)
        t = time.perf_counter()
        add_tvm_dispatch(m, (x, mask), options=opts)
        res["compile_s"][name] = time.perf_counter() - t
        layers[name] = m
        report = m._tvm_dispatch.report()
        res["bytes"][name] = {"tvm_kept": report.tvm_bytes, "captured": report.captured_bytes,
                              "pytorch_saved": report.pytorch_saved_bytes, "recompute_MFLOP": report.recompute_flops / 1e6}
    eager = copy.deepcopy(base)
    layers["eager"] = eager
    res["flops"] = step_flops(lambda: train_step(eager, x, mask)(0))
    if not args.no_compile:
        compiled = torch.compile(copy.deepcopy(base))
        t = time.perf_counter()
        train_step(compiled, x, mask)(0)
        res["compile_s"]["compile"] = time.perf_counter() - t
        layers["compile"] = compiled
    slow = {k: layers.pop(k) for k in list(layers) if k == "tvm-no-offload"}
    for name, m in slow.items():  # minutes per run at large shapes: timed alone, fewer runs
        res["train_ms"][name] = statistics.median(timed(train_step(m, x, mask), max(3, args.runs // 5), 1)) * 1e3
    steps = {k: train_step(m, x, mask) for k, m in layers.items()}
    times = interleaved(steps, args.runs, args.warmup)
    for name, ts in times.items():
        res["train_ms"][name] = statistics.median(ts) * 1e3
        print(f"  {name:15s} train step {res['train_ms'][name]:9.2f} ms", flush=True)
    times = interleaved({k: infer_step(layers[k], x, mask) for k in ("tvm", "eager")}, args.runs, args.warmup)
    for name, ts in times.items():
        res["infer_ms"][name] = statistics.median(ts) * 1e3
    assert layers["tvm"]._tvm_dispatch.calls_tvm > 0
    res["kernels_ms"] = kernel_breakdown(layers["tvm"], x, mask)
    if args.gemm_table:
        res["gemms"] = gemm_table(layers["tvm"])
    return res


def bf16_path() -> str:
    """What runs a bfloat16 GEMM here: the CPU's native bfloat16 instructions (AMX, AVX512-BF16)
    through oneDNN, or an emulation (float32 math on converted operands)."""
    from pathlib import Path

    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f") if f in flags]
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return f"bfloat16 ISA flags: {', '.join(isa) or 'none'}; oneDNN native bfloat16: {'yes' if native else 'no (emulated)'}"


def autocast_train_step(call: Callable[[int], torch.Tensor], params: list, dtype: torch.dtype | None) -> Callable[[int], None]:
    def step(i: int) -> None:
        torch.manual_seed(i)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = call(i)
        loss.float().sum().backward()
        for p in params:
            p.grad = None
    return step


def bench_autocast(model: str, batch: int, seq: int, args) -> dict:
    """One model at one shape: TVM autocast, eager autocast, torch.compile autocast, eager float32."""
    from tvmbridge.tools.whole_models import build_task

    low = torch.bfloat16
    torch.manual_seed(0)
    if model == "BertLayer":
        base = bert_layer()
        x, mask = bert_layer_inputs(batch, seq)
        call_of = lambda m: (lambda i: m(x.detach().requires_grad_(), mask))  # noqa: E731
        sample = ((x, mask), {})
    else:
        task = build_task("bert-mlm", "base", batch, seq)
        base = task.model
        call_of = lambda m: (lambda i: m(*task.args, **task.kwargs).loss)  # noqa: E731
        sample = (task.args, task.kwargs)
    res: dict = {"model": model, "shape": f"({batch},{seq})", "train_ms": {}, "compile_s": {}}
    res["flops"] = step_flops(lambda: autocast_train_step(call_of(base), list(base.parameters()), None)(0))
    tvm_model = copy.deepcopy(base)
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=low):
        add_tvm_dispatch(tvm_model, *sample)
    res["compile_s"]["tvm autocast"] = time.perf_counter() - t
    models = {"tvm autocast": (tvm_model, low), "eager autocast": (copy.deepcopy(base), low),
              "eager float32": (copy.deepcopy(base), None)}
    if not args.no_compile:
        compiled = torch.compile(copy.deepcopy(base))
        step = autocast_train_step(call_of(compiled), list(compiled.parameters()), low)
        t = time.perf_counter()
        step(0)
        res["compile_s"]["compile autocast"] = time.perf_counter() - t
        models["compile autocast"] = (compiled, low)
    steps = {k: autocast_train_step(call_of(m), list(m.parameters()), dt) for k, (m, dt) in models.items()}
    times = interleaved(steps, args.runs, args.warmup)
    for name, ts in times.items():
        res["train_ms"][name] = statistics.median(ts) * 1e3
        print(f"  {name:17s} train step {res['train_ms'][name]:9.2f} ms", flush=True)
    dispatch = tvm_model._tvm_dispatch
    assert dispatch.calls_tvm > 0 and dispatch.calls_fallback == 0, dispatch.explain()
    return res


def markdown_autocast(rows: list[dict], machine: str, args) -> str:
    out = [f"machine: {machine}", roofline_header(), bf16_path(),
           f"median of {args.runs} interleaved runs after {args.warmup} warm-up", "",
           "| model | shape | variant | train step ms | vs eager autocast | vs eager float32 | rate (of its dtype's peak) "
           "| compile s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ac, f32 = r["train_ms"]["eager autocast"], r["train_ms"]["eager float32"]
        for name, ms in r["train_ms"].items():
            comp = f"{r['compile_s'][name]:.1f}" if name in r["compile_s"] else ""
            rate = roofline_cell(r["flops"], ms / 1e3, torch.float32 if "float32" in name else torch.bfloat16)
            out.append(f"| {r['model']} | {r['shape']} | {name} | {ms:.1f} | {ms / ac:.2f}x | {ms / f32:.2f}x | {rate} "
                       f"| {comp} |")
    return "\n".join(out)


def markdown(rows: list[dict], machine: str, args) -> str:
    out = [f"machine: {machine}", roofline_header((torch.float32,)), f"median of {args.runs} interleaved runs after "
           f"{args.warmup} warm-up (tvm-no-offload: fewer, timed alone)", ""]
    out += ["| shape | variant | train step ms | vs eager | rate (of float32 peak) | compile s | kept for backward MiB "
            "| PyTorch saved MiB |", "|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for r in rows:
        eager = r["train_ms"]["eager"]
        for name, ms in r["train_ms"].items():
            b = r["bytes"].get(name, {})
            kept = f"{b['tvm_kept'] / mib:.2f}" if b else ""
            saved = f"{b['pytorch_saved'] / mib:.2f}" if b else ""
            comp = f"{r['compile_s'][name]:.1f}" if name in r["compile_s"] else ""
            rate = roofline_cell(r["flops"], ms / 1e3)
            out.append(f"| {r['shape']} | {name} | {ms:.2f} | {ms / eager:.2f}x | {rate} | {comp} | {kept} | {saved} |")
    out += ["", "| shape | inference (no_grad) tvm ms | eager ms | tvm/eager |", "|---|---|---|---|"]
    for r in rows:
        t, e = r["infer_ms"]["tvm"], r["infer_ms"]["eager"]
        out.append(f"| {r['shape']} | {t:.2f} | {e:.2f} | {t / e:.2f}x |")
    for r in rows:
        out += ["", f"per-kernel time of the default TVM step at {r['shape']} (ms per step, instrumented):", ""]
        out += [f"    {ms:8.2f}  {k}" for k, ms in r["kernels_ms"]]
    for r in rows:
        if "gemms" not in r:
            continue
        out += ["", f"GEMMs of the step at {r['shape']}, each timed alone (median of 10):", "",
                "| GEMM | operand shapes | per step | GFLOP | torch.matmul GFLOP/s | oneDNN GFLOP/s | chosen |",
                "|---|---|---|---|---|---|---|"]
        for g in r["gemms"]:
            one = f"{g['onednn_GFLOPs']:.0f}" if "onednn_GFLOPs" in g else "n/a"
            shapes = " x ".join(str(tuple(s)) for s in g["shapes"])
            out.append(f"| {g['gemm']} | {shapes} | {g['per_step']} | {g['GFLOP']:.3f} | "
                       f"{g['torch_GFLOPs']:.0f} | {one} | {g['chosen']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x14,8x128")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-offload-shapes", default="1x14", help="shapes at which to also time TVM's own matmuls")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--gemm-table", action="store_true",
                    help="also time each distinct GEMM of the step alone on torch.matmul (MKL) and oneDNN")
    ap.add_argument("--out", default="bench_results/bench_train")
    ap.add_argument("--tuning-db", default=None, help="also time the default step with this MetaSchedule database "
                                                      "(tvmbridge tune --model bert-layer-base): tvm-tuned")
    ap.add_argument("--autocast", action="store_true", help="mixed precision (bfloat16) instead, see above")
    ap.add_argument("--models", default="BertLayer,BertForMaskedLM", help="with --autocast")
    args = ap.parse_args()
    machine = machine_line()
    if args.autocast:
        print(machine, "\n" + roofline_header(), "\n" + bf16_path(), flush=True)
        rows = []
        for spec in args.shapes.split(","):
            b, s = (int(v) for v in spec.split("x"))
            for model in args.models.split(","):
                print(f"{model} training step under autocast(bfloat16) at ({b},{s}):", flush=True)
                rows.append(bench_autocast(model, b, s, args))
        write_results(args.out + "_autocast", machine, rows, markdown_autocast(rows, machine, args))
        return
    rows = []
    for spec in args.shapes.split(","):
        b, s = (int(v) for v in spec.split("x"))
        print(f"BertLayer training step at ({b},{s},768):", flush=True)
        rows.append(bench_shape(b, s, args))
    text = markdown(rows, machine, args)
    write_results(args.out, machine, rows, text)


if __name__ == "__main__":
    main()
