"""Train steps of timm CNNs at a user's batch, TVM against PyTorch eager in one process.

Per model (random weights, ``num_classes=10``, cross-entropy, SGD-free: forward and backward):
the step's interleaved median for eager, ``tvm`` (the default), ``tvm-no-fast-math`` and, with
``--ablate``, the default without each of the means a CNN step leans on (built with the mean
patched out for that compile only): ``tvm-shared-casts`` (a widening cast read by several kernels
written out once, ``backend/cast_per_consumer.py``), ``tvm-serial-channel-sums`` (BatchNorm's
per-channel sums without vector partial sums, ``backend/channel_reduction.py``). The largest
loss and gradient differences to eager are printed per variant; the CPU is named.

    python scripts/bench_cnn.py                                   # efficientnet_b0, resnet18, mobilenetv3_small_100
    python scripts/bench_cnn.py --models efficientnet_b0 --batch 32 --image 160 --ablate
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tvmbridge import add_tvm_dispatch  # noqa: E402
from tvmbridge.caches import CACHES  # noqa: E402
from tvmbridge.tools.roofline import roofline_header  # noqa: E402
from tvmbridge.tools.timing import interleaved, machine_line, write_results  # noqa: E402


@contextlib.contextmanager
def _shared_casts() -> Iterator[None]:
    import tvm

    from tvmbridge.backend import build

    saved = build.CastPerConsumer
    build.CastPerConsumer = tvm.transform.module_pass(lambda mod, ctx: mod, opt_level=0, name="NoCastPerConsumer")
    try:
        yield
    finally:
        build.CastPerConsumer = saved


@contextlib.contextmanager
def _serial_channel_sums() -> Iterator[None]:
    from tvmbridge.backend.channel_reduction import ChannelReduction

    saved = ChannelReduction.apply
    ChannelReduction.apply = lambda self, *args: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        ChannelReduction.apply = saved  # type: ignore[method-assign]


VARIANTS: dict[str, tuple[dict, Callable[[], contextlib.AbstractContextManager]]] = {
    "tvm": ({}, contextlib.nullcontext),
    "tvm-no-fast-math": ({"fast_math": False}, contextlib.nullcontext),
}
ABLATIONS = {"tvm-shared-casts": ({}, _shared_casts), "tvm-serial-channel-sums": ({}, _serial_channel_sums)}


def step_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[int], None]:
    def step(i: int) -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    return step


def differences(
    model: torch.nn.Module, eager: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """Largest loss and gradient differences of one step from the same weights."""
    out = []
    for m in (model, eager):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
        m.zero_grad(set_to_none=True)
    (la, ga), (lb, gb) = out
    return float((la - lb).abs()), max(float((a - b).abs().max()) for a, b in zip(ga, gb))


def bench_model(name: str, batch: int, image: int, runs: int, warmup: int, ablate: bool) -> list[dict]:
    import timm

    torch.manual_seed(0)
    base = timm.create_model(name, num_classes=10).train()
    x, y = torch.randn(batch, 3, image, image), torch.randint(0, 10, (batch,))
    models = {"eager": copy.deepcopy(base)}
    for variant, (options, patch) in {**VARIANTS, **(ABLATIONS if ablate else {})}.items():
        model = copy.deepcopy(base)
        with patch():
            add_tvm_dispatch(model, (x,), disk_cache=False, **options)
        CACHES.clear()  # the next variant compiles afresh, not from this one's result
        models[variant] = model
    diffs = {k: differences(m, models["eager"], x, y) for k, m in models.items() if k != "eager"}
    times = interleaved({k: step_of(m, x, y) for k, m in models.items()}, runs, warmup)
    eager = statistics.median(times["eager"])
    rows = []
    for k, ts in times.items():
        median = statistics.median(ts)
        loss, grad = diffs.get(k, (0.0, 0.0))
        rows.append(
            {
                "model": name,
                "batch": batch,
                "image": image,
                "variant": k,
                "ms": median * 1e3,
                "vs_eager": median / eager,
                "loss_diff": loss,
                "grad_diff": grad,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="efficientnet_b0,resnet18,mobilenetv3_small_100")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image", type=int, default=128)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ablate", action="store_true", help="also time the default without each CNN mean")
    ap.add_argument("--out", default="bench_results/bench_cnn")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    machine = machine_line()
    rows = [
        r
        for name in args.models.split(",")
        for r in bench_model(name, args.batch, args.image, args.runs, args.warmup, args.ablate)
    ]
    lines = [
        machine,
        roofline_header((torch.float32,)),
        f"interleaved medians of {args.runs} train steps after {args.warmup} warm-up",
        "",
        "| model | batch, image | variant | step ms | vs eager | loss diff | largest grad diff |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['batch']}, {r['image']}px | {r['variant']} | {r['ms']:.1f} | {r['vs_eager']:.2f}x | "
        f"{r['loss_diff']:.1e} | {r['grad_diff']:.1e} |"
        for r in rows
    ]
    write_results(args.out, machine, rows, "\n".join(lines))


if __name__ == "__main__":
    main()
