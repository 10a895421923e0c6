"""Kernels the compiled code calls at run time that are not TVM's own Relax lowering.

``gemm``: GEMMs of the libraries PyTorch ships, as packed functions (named by ``GemmSpec``);
``mt19937``: PyTorch's CPU random stream drawn by a vectorized TVM kernel, for dropout masks;
``library``: such kernels of the bridge's own compiled once per machine (the disk cache).
"""
