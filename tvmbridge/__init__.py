"""tvmbridge: train PyTorch modules through the TVM compiler.

``add_tvm_dispatch(module, sample_inputs)`` compiles the module's forward and backward with TVM
(Relax) for that call signature; matching calls then run on TVM, gradients flow into autograd, and
every other call runs PyTorch.
"""
import os as _os

# TVM's CPU thread pool spins after each parallel kernel; the offloaded matmuls run on PyTorch's
# own threads in between, and spinning TVM workers steal their cores (measured: matmuls 10-30%
# slower at (8,128)). Respect a user's own setting.
_os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

from .dispatch import add_tvm_dispatch  # noqa: E402
from .errors import ConversionError, UnsupportedOpError  # noqa: E402
from .pipeline import CompiledModule, compile_training  # noqa: E402

__all__ = ["CompiledModule", "ConversionError", "UnsupportedOpError", "add_tvm_dispatch", "compile_training"]
