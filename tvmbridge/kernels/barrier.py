"""``tvmbridge.barrier``: a packed function that hands back a copy of its input.

Operator fusion puts an elementwise chain into one kernel, and LLVM may then fuse a multiply with
the add after it (FMA: one rounding where C++ code rounds twice). Where the bridge must reproduce
PyTorch's float arithmetic to the bit (BatchNorm's running statistics), a value passes through
this opaque call: it is stored by one kernel and read by the next, rounded as PyTorch rounds it.
A copy, not the input itself: the VM plans memory as if a packed call's result were new.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import tvm_ffi

from .. import names

BARRIER = f"{names.PACKED_PREFIX}barrier"


@functools.cache
def register_barrier() -> None:
    def barrier(x: Any) -> Any:
        return tvm_ffi.from_dlpack(torch.from_dlpack(x).clone())

    tvm_ffi.register_global_func(BARRIER, barrier, override=True)
