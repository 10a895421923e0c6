"""tvmbridge: train PyTorch modules through the TVM compiler.

``add_tvm_dispatch(module, sample_inputs)`` compiles the module's forward and backward with TVM
(Relax) for that call signature; calls then run on TVM (a call of another signature compiles one
more variant), gradients flow into autograd, and a call no compiled code can fit runs PyTorch
with a warning. ``torch.compile(model, backend="tvmbridge")`` (``tvmbridge.dynamo``) runs each
graph dynamo captures through the same pipeline; ``compile_backend(**options)`` makes one with
other options.

The package is laid out as the compile runs: ``frontend`` (trace, convert) -> ``passes`` ->
``partition`` (joint graph, capture set, split) -> ``backend`` (offload, fast math, build) ->
``runtime`` (guard, autograd Function, masks) -> ``dynamo`` (the torch.compile backend); ``kernels``
holds what the compiled code calls at run time, ``tools`` the report, pictures, demo and command
line. ``pipeline`` runs the stages.
Public names are resolved lazily: importing the package does not import TVM.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "add_tvm_dispatch": "tvmbridge.runtime.dispatch",
    "remove_tvm_dispatch": "tvmbridge.runtime.dispatch",
    "compile_training": "tvmbridge.runtime.compiled",
    "compile_backend": "tvmbridge.dynamo",
    "compile_inference": "tvmbridge.runtime.inference",
    "check_double": "tvmbridge.tools.check",
    "DoubleCheckReport": "tvmbridge.tools.check",
    "InferenceModule": "tvmbridge.runtime.inference",
    "CompiledModule": "tvmbridge.runtime.compiled",
    "STAGE_NAMES": "tvmbridge.pipeline",
    "CompileOptions": "tvmbridge.options",
    "ConversionError": "tvmbridge.errors",
    "UnsupportedOpError": "tvmbridge.errors",
    "FallbackWarning": "tvmbridge.errors",
    "RecompileWarning": "tvmbridge.errors",
    "VerificationWarning": "tvmbridge.errors",
    "CaptureReport": "tvmbridge.runtime.report",
    "visualize": "tvmbridge.tools.visualize",
    "visualize_split": "tvmbridge.tools.visualize",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tvmbridge' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
