"""PyTorch's own code that reads a tensor's values only to choose between equal computations.

``nn.TransformerEncoder``/``nn.TransformerDecoder`` (and so ``nn.Transformer``) compare the mask
they are given with a causal mask of its size, ``bool((mask == causal).all())``, to pass the
layers ``is_causal=True``, a hint that lets attention skip the mask. ``torch.export`` cannot
trace a value read (``GuardOnDataDependentSymNode``): the tutorial's translation model and every
GPT written with ``nn.TransformerEncoder`` and ``generate_square_subsequent_mask`` failed to
compile. While the bridge traces, the detection answers without reading the mask: the caller's
``is_causal`` if given, else ``False``, so the mask is applied as given: the same attention.

Where PyTorch's code needs the value itself (BatchNorm's cumulative average, a packed sequence's
batch sizes), the trace fails, and the functions below name the cause in the error.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys

import torch
from torch.nn.modules import transformer

from .trace_patches import ScopedPatch


def _detect_is_causal_mask(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
    """``transformer._detect_is_causal_mask``, value-free in the threads that trace."""
    if _PATCH.here:
        return is_causal is True
    return _PATCH.original(mask, is_causal, size)


_PATCH = ScopedPatch(transformer, "_detect_is_causal_mask", _detect_is_causal_mask)


def value_free_hints() -> contextlib.AbstractContextManager[None]:
    """The block (a trace in this thread) runs the value-free detections above."""
    return _PATCH.scope()


def value_read_named(module: torch.nn.Module, exc: BaseException) -> str:
    """Which of PyTorch's own value reads stopped the trace that raised ``exc``, and what to do;
    ``""`` where none of those known here."""
    if _packed_sequence_in(exc):
        return (
            "nn.utils.rnn.pack_padded_sequence takes its sizes from the lengths' values, which compiled "
            "code cannot: run the RNN on the padded batch (mask the padded steps in the loss), or use "
            "torch.compile(model, backend='tvmbridge'), which packs in PyTorch, or fallback=True"
        )
    if "data-dependent" in str(exc):
        return _cumulative_batch_norms(module)
    if "fake tensor in the exported program constant" in str(exc):
        return (
            "the forward writes a tensor through .data (self.ema.data.mul_(...), w.data.clamp_(...)), which "
            "torch.export cannot take: write the tensor itself under `with torch.no_grad():` (a buffer's "
            "update is compiled, as BatchNorm's running statistics are; a parameter's is the optimizer's), "
            "move the write out of forward, or pass fallback=True"
        )
    return ""


def _cumulative_batch_norms(module: torch.nn.Module) -> str:
    """What to do where a BatchNorm with ``momentum=None`` trains (its cumulative average reads
    ``1 / float(num_batches_tracked)`` as a number on every call), or ``""``."""
    cumulative = [
        name or type(module).__name__
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        and m.momentum is None
        and m.training
        and m.track_running_stats
    ]
    if not cumulative:
        return ""
    shown = ", ".join(cumulative[:3]) + (", ..." if len(cumulative) > 3 else "")
    return (
        f"BatchNorm with momentum=None ({shown}) reads num_batches_tracked as a number on every training call "
        "(its cumulative average), which compiled code cannot: give it a momentum (0.1 is the default), "
        "or pass fallback=True to keep PyTorch in train mode (eval mode compiles)"
    )


def _packed_sequence_in(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) passed through a frame holding a
    ``PackedSequence`` (``pack_padded_sequence`` making one, an RNN reading one): their batch
    sizes are the lengths' values, which no trace can follow."""
    from torch.nn.utils.rnn import PackedSequence

    seen: BaseException | None = exc
    while seen is not None:
        tb = seen.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name == "pack_padded_sequence" or any(
                isinstance(v, PackedSequence) for v in frame.f_locals.values()
            ):
                return True
            tb = tb.tb_next
        seen = seen.__cause__ or seen.__context__
    return False


def _branch_site(exc: BaseException) -> tuple[str, str] | None:
    """(``file:line``, source line) of the user's code whose branch torch.export could not decide,
    from the message torch gives a data-dependent guard: its "The following call raised this
    error" block, or else its "Caused by: (path:line in function)" where that is not torch's own."""
    text = str(exc)
    at = text.find("The following call raised this error:")
    if at >= 0:
        lines = text[at:].splitlines()[1:3]
        found = re.match(r'\s*File "([^"]+)", line (\d+)', lines[0]) if lines else None
        if found is not None:
            code = lines[1].strip() if len(lines) > 1 else ""
            return f"{os.path.basename(found.group(1))}:{found.group(2)}", code
    caused = re.search(r"Caused by: \(([^()]+?):(\d+) in \w+\)", text)
    if caused is None or caused.group(1).startswith("torch/") or "/torch/" in caused.group(1):
        return None
    path, line = caused.group(1), int(caused.group(2))
    full = next((os.path.join(b, path) for b in sys.path if os.path.isfile(os.path.join(b, path))), path)
    return f"{os.path.basename(path)}:{line}", linecache.getline(full, line).strip()


def data_dependent_hint(exc: BaseException) -> str:
    """What to do about a branch on a tensor's values, naming the line that branches where torch says."""
    site = _branch_site(exc)
    where = (f" (at {site[0]}: `{site[1]}`)" if site[1] else f" (at {site[0]})") if site else ""
    hint = (
        f"; the forward branches on a tensor's values{where} (a Python `if` on a tensor, `.item()`), which "
        "compiled code keeps only as the sample took it, guarded at run time, and only on a bool or integer read: "
        "move it out of forward, or pass fallback=True: PyTorch then runs this module's own code and its "
        "submodules compile by themselves"
    )
    if site and "layerdrop" in site[1].lower():
        hint += (
            "; this one is LayerDrop (a random draw decides whether a layer runs in training): a config's "
            "*layerdrop=0.0 compiles the model whole"
        )
    return hint
