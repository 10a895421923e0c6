"""The main job: a BertLayer (random weights) trained through TVM next to PyTorch.

Builds ``BertLayer(BertConfig())`` with eager attention, dispatches it to TVM, runs a few SGD steps
on both the TVM module and a PyTorch copy under the same seeds, and prints the max errors of the
output and of every gradient, the compile time, and the time per training step of both (after a
warm-up, the two interleaved: the first calls of either are slower, and a shared machine drifts).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch

from analysis.models import bert_layer, bert_layer_inputs

from ..options import CompileOptions
from ..runtime.dispatch import add_tvm_dispatch, dispatcher_of
from .roofline import roofline_cell, roofline_header, step_flops
from .timing import interleaved, machine_line


def _grad_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s gradient (after the backward, the input and every parameter have one)."""
    assert t.grad is not None
    return t.grad.clone()


def run(
    batch: int = 1, seq: int = 14, steps: int = 5, options: CompileOptions | None = None, timing_runs: int = 20
) -> dict:
    """Compile, train ``steps`` SGD steps next to PyTorch, time both; returns the worst errors,
    the step times and the compile time."""
    torch.manual_seed(0)
    layer = bert_layer()
    ref = copy.deepcopy(layer)
    x, mask = bert_layer_inputs(batch, seq)
    target = torch.randn(batch, seq, 768)
    print(f"BertLayer(BertConfig()) train mode, input ({batch},{seq},768), {steps} SGD steps")
    t0 = time.perf_counter()
    add_tvm_dispatch(layer, (x, mask), options=options)
    compile_s = time.perf_counter() - t0
    compiled = dispatcher_of(layer).compiled
    assert compiled is not None  # for the sample
    print(f"compiled forward+backward in {compile_s:.1f}s: {compiled.summary()}")

    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.01) for m in (layer, ref)}
    worst: dict[str, float] = {}
    for step in range(steps):
        results = {}
        for name, m in (("tvm", layer), ("pytorch", ref)):
            opt = opts[id(m)]
            torch.manual_seed(1000 + step)
            xi = x.clone().requires_grad_()
            opt.zero_grad()
            out = m(xi, mask)
            loss = torch.nn.functional.mse_loss(out, target)
            loss.backward()
            grads = {"input": _grad_copy(xi), **{n: _grad_copy(p) for n, p in m.named_parameters()}}
            results[name] = (loss.item(), out.detach(), grads)
            opt.step()
        (la, oa, ga), (lb, ob, gb) = results["tvm"], results["pytorch"]
        errs = {"output": (oa - ob).abs().max().item()}
        errs.update({k: (ga[k] - gb[k]).abs().max().item() for k in ga})
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        print(
            f"step {step}: loss tvm {la:.6f}  pytorch {lb:.6f}  max err output {errs['output']:.2e}  "
            f"max err grads {max(v for k, v in errs.items() if k != 'output'):.2e}"
        )
    assert dispatcher_of(layer).calls_tvm == steps, "the TVM path was not taken"
    print("max abs error over all steps:")
    for k, v in worst.items():
        print(f"  {k:40s} {v:.3e}")
    med = time_steps({"tvm": layer, "pytorch": ref}, x, mask, target, timing_runs)
    print(
        f"time per training step (forward + backward, median of {timing_runs} interleaved after warm-up): "
        f"tvm {med['tvm'] * 1e3:.1f} ms, pytorch {med['pytorch'] * 1e3:.1f} ms, "
        f"ratio {med['tvm'] / med['pytorch']:.2f}x; "
        f"compile {compile_s:.1f}s; {torch.get_num_threads()} threads"
    )
    flops = step_flops(lambda: torch.nn.functional.mse_loss(ref(x.clone().requires_grad_(), mask), target).backward())
    ref.zero_grad(set_to_none=True)
    print(f"on {machine_line()}\n{roofline_header((torch.float32,))}")
    print(
        f"step {flops / 1e9:.2f} GFLOP: tvm {roofline_cell(flops, med['tvm'])}, "
        f"pytorch {roofline_cell(flops, med['pytorch'])}"
    )
    return {"worst": worst, "step_ms": {k: v * 1e3 for k, v in med.items()}, "compile_s": compile_s}


def time_steps(
    modules: dict[str, torch.nn.Module],
    x: torch.Tensor,
    mask: torch.Tensor,
    target: torch.Tensor,
    runs: int,
    warmup: int = 10,
) -> dict[str, float]:
    """Median seconds of one forward + backward per module, interleaved after a warm-up."""

    def step(m: torch.nn.Module) -> Callable[[int], None]:
        def run_once(i: int) -> None:
            torch.nn.functional.mse_loss(m(x.clone().requires_grad_(), mask), target).backward()
            m.zero_grad(set_to_none=True)

        return run_once

    times = interleaved({k: step(m) for k, m in modules.items()}, runs, warmup)
    return {k: statistics.median(v) for k, v in times.items()}
