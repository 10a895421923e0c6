"""What a compiled module keeps for its backward, next to what PyTorch's autograd keeps.

TVM side: captured forward values plus the dropout masks the backward reads. PyTorch side: the
bytes autograd saves for the same module and inputs on a real run, measured with
``saved_tensors_hooks`` over unique storages (``analysis.profile.measure_saved_bytes``). On both
sides parameters and the user's inputs are left out: the caller holds them anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .compiled import CompiledModule


@dataclass
class CaptureReport:
    policy: str
    captured: list[tuple[str, tuple[int, ...] | None, str | None, int]]  # name, shape, dtype, bytes
    captured_bytes: int
    mask_bytes: int
    save_all_bytes: int
    pytorch_saved_bytes: int
    recomputed: int
    recompute_flops: float

    @property
    def tvm_bytes(self) -> int:
        return self.captured_bytes + self.mask_bytes

    def __str__(self) -> str:
        mib = 2**20
        lines = [
            f"capture policy {self.policy}: TVM keeps {self.tvm_bytes / mib:.2f} MiB "
            f"({self.captured_bytes / mib:.2f} captured + {self.mask_bytes / mib:.2f} dropout masks); "
            f"PyTorch saves {self.pytorch_saved_bytes / mib:.2f} MiB; save-all would capture "
            f"{self.save_all_bytes / mib:.2f} MiB; {self.recomputed} values recomputed "
            f"(+{self.recompute_flops / 1e6:.2f} MFLOP)",
            "captured values:",
        ]
        for name, shape, dtype, n in self.captured:
            lines.append(f"  {name:24s} {str(shape):22s} {str(dtype):8s} {n / 1024:10.1f} KiB")
        return "\n".join(lines)


def pytorch_saved_bytes(forward: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes autograd keeps for one real forward (grads enabled; float inputs require grad)."""
    from analysis.profiling.profile import measure_saved_bytes

    def prep(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.is_floating_point())
        return x

    args, kwargs = pytree.tree_map(prep, (args, kwargs))
    inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    exclude = list(module.parameters()) + list(module.buffers()) + inputs
    with torch.enable_grad():
        _, saved = measure_saved_bytes(forward, *args, exclude=exclude, **kwargs)
    return saved


def capture_report(
    compiled: CompiledModule, forward: Any, module: torch.nn.Module, args: tuple, kwargs: dict
) -> CaptureReport:
    """The report for ``compiled``; PyTorch's side measured by one real call of ``forward``."""
    joint = compiled.split.joint
    captured = [(c, joint.nodes[c].shape, joint.nodes[c].dtype, joint.nodes[c].nbytes) for c in compiled.split.captures]
    return CaptureReport(
        policy=compiled.options.policy_name,
        captured=captured,
        captured_bytes=compiled.captured_bytes(),
        mask_bytes=compiled.mask_bytes(),
        save_all_bytes=compiled.save_all_bytes(),
        pytorch_saved_bytes=pytorch_saved_bytes(forward, module, args, kwargs),
        recomputed=len(compiled.split.recomputed),
        recompute_flops=compiled.recompute_flops(),
    )
