"""Every scheduled kernel of a zoo model's training compile against its unscheduled form.

On the device the model would train on (``--device cuda``: dlight's GPU schedules run on the GPU,
the serial forms on the CPU), one compile per model from its first zoo batch; prints each kernel
whose outputs differ and exits 1 if any does.

    python scripts/check_kernels.py --device cuda --only timm-deit_tiny_patch16_224,resnet
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tvmbridge import compile_training  # noqa: E402
from tvmbridge.tools.kernel_check import check_kernels  # noqa: E402
from tvmbridge.tools.timing import machine_line  # noqa: E402
from tvmbridge.tools.zoo.harness import FIRST, to_device  # noqa: E402
from tvmbridge.tools.zoo.models import get  # noqa: E402


class LossOf(torch.nn.Module):
    """The zoo entry's forward and loss, positional (what ``compile_training`` traces)."""

    def __init__(self, entry, model: torch.nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.entry, self.model, self.keys = entry, model, keys

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.entry.forward(self.model, dict(zip(self.keys, args)))[1]


def check(name: str, device: str) -> int:
    entry = get(name)
    torch.manual_seed(0)
    model = entry.build().train().to(device)
    batch = to_device(entry.make_batch(*FIRST, 1), device)
    start = time.perf_counter()
    compiled = compile_training(LossOf(entry, model, list(batch)), tuple(batch.values()))
    diffs = check_kernels(compiled)
    bad = [d for d in diffs if not d.ok]
    print(f"{name}: {len(diffs)} kernels checked, {len(bad)} differ ({time.perf_counter() - start:.0f} s)", flush=True)
    for d in bad:
        print(f"  {d.name}: max |diff| {d.max_abs_diff:.3g} (max |value| {d.max_abs_value:.3g})", flush=True)
    return len(bad)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", required=True, help="comma-separated zoo model names")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    bad = 0
    for name in args.only.split(","):
        try:
            bad += check(name, args.device)
        except Exception as exc:  # noqa: BLE001 - the next model still runs
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)

            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
