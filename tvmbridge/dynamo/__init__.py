"""The ``torch.compile`` backend: ``torch.compile(model, backend="tvmbridge")``.

Registered under that name by the ``torch_dynamo_backends`` entry point (``pip install`` is
enough); ``compile_backend(**options)`` makes one with other :class:`CompileOptions`.
"""

from .backend import Backend, CompiledGraph, compile_backend, tvmbridge

__all__ = ["Backend", "CompiledGraph", "compile_backend", "tvmbridge"]
