"""Profiling one call on fake tensors: ``meta`` (no real memory), ``trace`` (graph capture with
meta values), ``flops`` (FLOP formulas and the per-module counter), ``profile`` (shapes, memory
and FLOPs per node)."""
