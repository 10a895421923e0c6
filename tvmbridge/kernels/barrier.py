"""``tvmbridge.barrier``: a packed function that hands back a copy of its input.

Operator fusion puts an elementwise chain into one kernel, and LLVM may then fuse a multiply with
the add after it (FMA: one rounding where C++ code rounds twice). Where the bridge must reproduce
PyTorch's float arithmetic to the bit (BatchNorm's running statistics), a value passes through
this opaque call: it is stored by one kernel and read by the next, rounded as PyTorch rounds it.
A copy, not the input itself: the VM plans memory as if a packed call's result were new.

Only a target that contracts needs it: the CPU target has no FMA unless ``fp_contract`` asks
for it (``devices.target_for``), and there :func:`drop_barriers` takes the barriers out before
fusion (a BatchNorm layer's running averages are then one kernel, not three and two library
calls).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import tvm
import tvm_ffi
from tvm import relax

from .. import names
from ..ir import RewriteBindings, is_op

BARRIER = f"{names.PACKED_PREFIX}barrier"


@functools.cache
def register_barrier() -> None:
    def barrier(x: Any) -> Any:
        return tvm_ffi.from_dlpack(torch.from_dlpack(x).clone())

    tvm_ffi.register_global_func(BARRIER, barrier, override=True)


def _without_barrier(value: relax.Expr, bound: dict) -> relax.Expr | None:
    if is_op(value, "relax.call_pure_packed") and str(value.args[0].global_symbol) == BARRIER:
        return value.args[1]
    return None


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.DropBarriers")
def drop_barriers(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every barrier replaced by its input, for a target whose kernels round each multiply and add
    apart (``devices.rounds_every_op``)."""
    mod = RewriteBindings([_without_barrier])(mod)  # type: ignore[operator]  # module_pass
    return relax.transform.CanonicalizeBindings()(mod)
