"""tvmbridge: train PyTorch modules through the TVM compiler.

``add_tvm_dispatch(module, sample_inputs)`` compiles the module's forward and backward with TVM
(Relax) for that call signature; matching calls then run on TVM, gradients flow into autograd, and
every other call runs PyTorch.
"""
import os as _os

# TVM's CPU thread pool spins after each parallel kernel; the offloaded matmuls run on PyTorch's
# own threads in between, and spinning TVM workers steal their cores (measured: matmuls 10-30%
# slower at (8,128)). Respect a user's own setting.
#
# The pool's size is left to TVM: TVM_NUM_THREADS, else OMP_NUM_THREADS, else half the logical
# CPUs on x86 (TVM assumes hyper-threading), fixed when the pool starts. On a 2-vCPU VM that is
# one thread, so TVM's own kernels run serially while PyTorch's GEMMs use both cores. Measured on
# such a VM (Zen 4), a BertLayer step at (8,128): TVM_NUM_THREADS=2 halves a lone elementwise
# kernel (1.3 -> 0.7 ms) but inside the step TVM's kernels took 36 ms instead of 25 (its worker
# contends with PyTorch's OpenMP workers, which spin after each GEMM), and with spinning TVM
# workers 93 ms; OMP_WAIT_POLICY=PASSIVE slowed eager PyTorch by a third. So one pool owning the
# cores at a time wins there; on many-core machines TVM's default gives it half of them.
_os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

from .dispatch import add_tvm_dispatch  # noqa: E402
from .errors import ConversionError, UnsupportedOpError  # noqa: E402
from .pipeline import CompiledModule, compile_training  # noqa: E402

__all__ = ["CompiledModule", "ConversionError", "UnsupportedOpError", "add_tvm_dispatch", "compile_training"]
