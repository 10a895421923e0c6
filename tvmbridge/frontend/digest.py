"""A digest of an exported program: what the compile of its graph depends on.

The code of every graph module in it (an export before decomposition keeps ``no_grad`` and
autocast regions as submodules), every node's value as metadata (shape, dtype, strides, storage
offset: what the code leaves to defaults, as a factory's dtype under ``set_default_dtype``), the
lifted constants' values and the shape symbols' ranges. Node metadata that does not change
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
    for name, module in ep.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:  # what the code leaves to defaults (a factory's dtype)
                h.update(repr((name, node.name, _meta(node.meta.get("val")))).encode())
    for name, value in sorted(ep.constants.items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(repr((tuple(value.shape), value.dtype)).encode())
            h.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())  # 0-d too
        else:
            h.update(repr(value).encode())
    h.update(repr(sorted(map(str, ep.range_constraints.items()))).encode())
    return h.hexdigest()


def _meta(val: object) -> object:
    """A node's value as metadata: each tensor's shape, dtype, strides and storage offset."""
    if isinstance(val, (tuple, list)):
        return tuple(_meta(v) for v in val)
    if isinstance(val, torch.Tensor):
        try:
            layout: object = (tuple(map(str, val.stride())), str(val.storage_offset()))
        except (RuntimeError, NotImplementedError):  # a layout without strides (sparse)
            layout = str(val.layout)
        return (tuple(map(str, val.shape)), str(val.dtype), str(val.device), layout)
    return str(val) if val is not None else None
