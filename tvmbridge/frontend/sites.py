"""What the compiled code needs drawn per call: the random sites the converters record.

Plain data, read by the runtime (``runtime/random.py`` draws each site from PyTorch's generator)
and by the pipeline; sizes the trace left symbolic are kept as their expressions' text and
evaluated at each call's sizes (:func:`tvmbridge.sizes.evaluate_dims`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sizes import evaluate_dims


def int_dims(dims: tuple[int | str, ...]) -> list[int]:
    """Sizes or strides bound to a call's sizes (``bind``): ints; a symbolic one is an error."""
    ints = [d for d in dims if isinstance(d, int)]
    if len(ints) != len(dims):
        raise ValueError(f"size {dims} is symbolic: bind it to the call's sizes first")
    return ints


@dataclass(frozen=True)
class TensorMeta:
    """Shape, strides and dtype of a tensor argument of a random op (its values are not used)."""

    shape: tuple[int | str, ...]
    stride: tuple[int | str, ...]
    dtype: torch.dtype

    def bind(self, sizes: dict[str, int]) -> TensorMeta:
        return TensorMeta(evaluate_dims(self.shape, sizes), evaluate_dims(self.stride, sizes), self.dtype)


@dataclass(frozen=True)
class SizeList:
    """A size-list argument of a random op (``rand``'s ``size``): ints, symbolic sizes as their
    expressions' text, evaluated at each call's sizes."""

    dims: tuple[int | str, ...]

    def bind(self, sizes: dict[str, int]) -> SizeList:
        return SizeList(evaluate_dims(self.dims, sizes))

    def value(self) -> list[int]:
        return int_dims(self.dims)


@dataclass(frozen=True)
class RandomSite:
    """One random value the compiled code needs per call, drawn by PyTorch in graph order.

    ``kind`` ``"dropout"``: the scaled mask of a dropout of rate ``p`` over a tensor laid out as
    ``shape``/``stride``; ``"op"``: the result of ``op(*args, **kwargs)`` with every
    :class:`TensorMeta` argument replaced by an empty tensor of that layout."""

    kind: str
    shape: tuple[int | str, ...]  # a symbolic size as its expression's text (``s0``)
    stride: tuple[int | str, ...]
    dtype: torch.dtype
    p: float = 0.0
    offset: int | str = 0  # a dropout input's storage offset (a GPU's fused kernel reads its alignment)
    op: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @property
    def symbolic(self) -> bool:
        metas = [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, TensorMeta)]
        lists = [a for a in (*self.args, *self.kwargs.values()) if isinstance(a, SizeList)]
        return any(
            isinstance(d, str)
            for d in (
                self.offset,
                *self.shape,
                *self.stride,
                *(x for m in metas for x in m.shape),
                *(x for s in lists for x in s.dims),
            )
        )

    def bind(self, sizes: dict[str, int]) -> RandomSite:
        """This site at the call's sizes (``sizes``: symbol name -> size)."""
        if not self.symbolic:
            return self
        args = tuple(a.bind(sizes) if isinstance(a, (TensorMeta, SizeList)) else a for a in self.args)
        kwargs = {k: v.bind(sizes) if isinstance(v, (TensorMeta, SizeList)) else v for k, v in self.kwargs.items()}
        return dataclasses.replace(
            self,
            shape=evaluate_dims(self.shape, sizes),
            stride=evaluate_dims(self.stride, sizes),
            offset=evaluate_dims((self.offset,), sizes)[0],
            args=args,
            kwargs=kwargs,
        )
