"""The bridge's converters, one module per family, each registered by the ``@converter`` decorator.

TVM's Relax frontend is built for inference; these replace or add the converters it would get
silently wrong for training, and refuse what they cannot convert exactly:

* ``random``: random ops become per-call inputs drawn by PyTorch, never values frozen at compile time;
* ``normalization``: BatchNorm in the arithmetic of ATen's CPU kernel (train and eval), group norm;
* ``linear``: matmul, addmm, linear and convolution in the input's dtype;
* ``indexing``: embedding, gather, take, ``x[idx]``, select, with range checks;
* ``assertions``: run-time checks on values (range checks, asserts, branches as sampled) as flags;
* ``scatter``: ``x[idx] = v``, ``index_add``/``index_copy``/``index_fill``, ``scatter(_add)``, ``put``,
  ``masked_scatter``;
* ``layout``: slices, ``slice_scatter``, repeat, squeeze, cat, arange, empty, pad, detach at traced shapes;
* ``pooling``: the arguments the frontend would ignore refused or honoured;
* ``elementwise``: hardtanh, clamp, elu with PyTorch's gradients at their edges;
* ``reductions``: amax/amin, 0-d reductions, vector norms;
* ``resampling``: nearest and bilinear interpolation as ATen's gathers; antialiased and bicubic refused;
* ``recurrent``: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` of any depth and direction, with their final states;
* ``experts``: mixture-of-experts routing (``histc``, grouped products) at static shapes.

To add one: a function ``fn(importer, node)`` in the family's module under
``@converter("<aten overload name>")`` (``wraps_default=True`` to get TVM's converter of the op
as a third argument). ``registry`` tells more.
"""

from __future__ import annotations

from . import (
    assertions,
    elementwise,
    experts,
    indexing,
    layout,
    linear,
    normalization,
    pooling,
    random,
    recurrent,
    reductions,
    resampling,
    scatter,
)
from .registry import CONVERTERS, Converter, bind, converter

FAMILIES = (
    random,
    normalization,
    linear,
    indexing,
    layout,
    pooling,
    elementwise,
    reductions,
    resampling,
    recurrent,
    experts,
    scatter,
    assertions,
)

__all__ = ["CONVERTERS", "Converter", "FAMILIES", "bind", "converter"]
