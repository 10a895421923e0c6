"""Round-robin timing, shared by the demo and ``scripts/bench_train.py``.

Each round runs one step of every variant, so that drift of a shared machine (step-to-step noise
of ~10% on the 2-core dev VMs) hits all variants alike; compare medians, never single runs.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path


def interleaved(steps: dict[str, Callable[[int], None]], runs: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of each of ``runs`` calls ``step(i)`` per variant, after ``warmup`` untimed rounds."""
    out: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(warmup + runs):
        for name, step in steps.items():
            t = time.perf_counter()
            step(i)
            dt = time.perf_counter() - t
            if i >= warmup:
                out[name].append(dt)
    return out


def cpu_name() -> str:
    """The CPU model as ``lscpu`` names it, with its family and model numbers (a VM may call a
    Zen 3 and a Zen 5 both "AMD EPYC"): every reported figure names its machine."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def machine_line() -> str:
    """The CPU, cores, torch threads, torch version, where TVM's parallel loops run and the GPU
    where one is visible: the line every benchmark starts with."""
    import torch

    from ..parallel_launch import status

    line = f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    line += f", TVM's loops on {status()}"
    if torch.cuda.is_available():
        line += f"; GPU {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return line


def write_results(out: str, machine: str, rows: list, text: str) -> None:
    """Print the markdown ``text`` and write ``out.json`` (machine and rows) and ``out.md``."""
    print(text)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text + "\n")
