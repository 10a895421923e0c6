"""Backend: the split halves become machine code.

``offload`` (dense matmuls to the GEMM libraries PyTorch ships) and ``fast_math`` are the last
Relax passes; ``build`` lowers, fuses, schedules (``cpu_schedules`` on CPU, dlight on GPU) and
compiles for ``llvm``, ``cuda`` or ``rocm``.
"""
