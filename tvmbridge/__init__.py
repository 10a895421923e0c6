"""tvmbridge: train PyTorch modules through the TVM compiler.

``add_tvm_dispatch(module, sample_inputs)`` compiles the module's forward and backward with TVM
(Relax) for that call signature; matching calls then run on TVM, gradients flow into autograd, and
every other call runs PyTorch.
"""
from .dispatch import add_tvm_dispatch
from .errors import ConversionError, UnsupportedOpError
from .pipeline import CompiledModule, compile_training

__all__ = ["CompiledModule", "ConversionError", "UnsupportedOpError", "add_tvm_dispatch", "compile_training"]
