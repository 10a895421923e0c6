"""A digest of an exported program: what the compile of its graph depends on.

The code of every graph module in it (an export before decomposition keeps ``no_grad`` and
autocast regions as submodules), each placeholder's shape, dtype, strides and storage offset,
the lifted constants' values and the shape symbols' ranges. Node metadata that does not change
the computation (stack traces, module paths) is left out, so a model's identical layers digest
alike.
"""

from __future__ import annotations

import hashlib

import torch
from torch.export import ExportedProgram


def program_digest(ep: ExportedProgram) -> str:
    h = hashlib.sha256()
    for name, module in ep.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            h.update(name.encode())
            h.update(module.code.encode())
    for node in ep.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        layout = (tuple(map(str, val.stride())), str(val.storage_offset())) if isinstance(val, torch.Tensor) else ()
        shape = tuple(map(str, getattr(val, "shape", ())))
        h.update(repr((node.name, shape, str(getattr(val, "dtype", "")), layout)).encode())
    for name, value in sorted(ep.constants.items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(repr((tuple(value.shape), value.dtype)).encode())
            h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())  # 0-d too
        else:
            h.update(repr(value).encode())
    h.update(repr(sorted(map(str, ep.range_constraints.items()))).encode())
    return h.hexdigest()
