"""Runtime: what happens at every call of a dispatched module.

``dispatch`` decides whether the compiled code fits the call (else PyTorch runs it), ``masks``
draws the call's dropout masks from PyTorch's RNG, ``function`` runs the compiled halves inside
PyTorch's autograd with tensors crossing by DLPack; ``report`` compares what the backward keeps
with what PyTorch's autograd keeps for the same call.
"""
