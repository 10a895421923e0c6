"""The decompositions the bridge exports with: torch.export's core-ATen table, minus random ops,
plus attention written out as ATen's own math.

Random ops are left whole: decomposing one can change how it draws from the generator
(``bernoulli(p)`` becomes ``rand_like(p) < p``), and the per-call draws must be PyTorch's own.
``scaled_dot_product_attention`` is a random op (its dropout), so it would be left whole too, and
no converter can take it with dropout. It is written out as ATen's
``_scaled_dot_product_attention_math`` (the kernel eager PyTorch runs on CPU whenever
``dropout_p > 0``): scale q and k by sqrt(scale) each, add the mask, ``_safe_softmax``, then
``aten.dropout``, whose mask the runtime draws from PyTorch's generator exactly as eager does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as ATen's math kernel computes it (attention.cpp):
    bfloat16/float16 inputs (autocast) are upcast to float32 and the result cast back."""
    low = query.dtype in (torch.bfloat16, torch.float16)
    if low:

        def wide(t: torch.Tensor) -> torch.Tensor:
            return t if t.dtype == torch.bool else t.float()

        q, k, v, mask = wide(query), wide(key), wide(value), None if attn_mask is None else wide(attn_mask)
        out = sdpa_math(q, k, v, mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return out.to(query.dtype)
    negative = scale is not None and scale < 0
    factor = (
        math.sqrt(abs(scale) if negative else scale) if scale is not None else 1 / math.sqrt(math.sqrt(query.shape[-1]))
    )
    q = query * (-factor if negative else factor)
    if is_causal:
        causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        attn_mask = _additive_mask(causal, query.dtype)
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _additive_mask(attn_mask, query.dtype)
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    attn = q @ (key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn = attn + attn_mask
    attn = aten._safe_softmax.default(attn, -1)
    if dropout_p > 0:
        attn = aten.dropout.default(attn, dropout_p, True)
    return attn @ value


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as ATen adds it: 0 where kept, -inf where masked."""
    return torch.where(
        mask,
        torch.zeros((), dtype=dtype, device=mask.device),
        torch.full((), float("-inf"), dtype=dtype, device=mask.device),
    )


def hardswish_kinks(x: torch.Tensor) -> torch.Tensor:
    """``hardswish`` as ``x * hardtanh(x + 3, 0, 6) / 6``: the core table's ``clamp`` passes the
    gradient at x = -3 and 3, ATen's ``hardswish_backward`` does not (``hardtanh`` excludes its
    bounds, as the bridge converts it)."""
    return x * aten.hardtanh.default(x + 3, 0.0, 6.0) / 6


def hardsigmoid_kinks(x: torch.Tensor) -> torch.Tensor:
    """``hardsigmoid`` as ``hardtanh(x + 3, 0, 6) / 6``, for the same reason."""
    return aten.hardtanh.default(x + 3, 0.0, 6.0) / 6


def safe_softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``_safe_softmax`` (0 on rows that are all ``-inf``) with those rows' input set to 0 before
    the softmax: the core table's form computes their NaN softmax and selects 0 over it, and the
    softmax gradient then reads the NaN (NaN gradients where PyTorch's are 0)."""
    if dtype is not None:
        x = x.to(dtype)
    keep = (x != float("-inf")).any(dim, keepdim=True)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    out = torch.softmax(torch.where(keep, x, zero), dim)
    return torch.where(keep, out, zero)


def multilabel_margin_loss(
    input: torch.Tensor, target: torch.Tensor, reduction: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``multilabel_margin_loss_forward`` as ATen's kernel computes it: the core table's form
    also counts the positions after a row's first ``-1`` (as label 0), a loss up to twice eager's."""
    shape = target.shape
    input, target = torch.atleast_2d(input), torch.atleast_2d(target)
    dim = input.shape[1]
    idx = torch.arange(dim, device=target.device)
    end = torch.amin(torch.where(target == -1, idx, dim), dim=-1, keepdim=True)
    listed = idx < end  # (batch, k): the k-th label is before the row's end
    u = torch.gather(input, -1, torch.where(listed, target, 0))
    is_target = torch.any(idx == torch.where(listed, target, -1).unsqueeze(-1), dim=1)
    z = ((1.0 - u.T.unsqueeze(-1) + input).clamp_min(0) / dim).to(input.dtype)
    z = torch.where(is_target | ~listed.T.unsqueeze(-1), 0, z)  # (k, batch, j)
    if reduction == 1:
        loss = z.sum(dim=(0, -1)).mean()
    elif reduction == 2:
        loss = z.sum()
    else:
        loss = z.sum(dim=(0, -1)).reshape(shape[:-1])
    return loss, is_target.to(input.dtype).reshape(shape)


def embedding_bag(
    weight: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``nn.EmbeddingBag`` (sum, mean; offsets or fixed-size bags; per-sample weights; a
    padding index) as gathered rows added into their bags; an empty bag is 0 as in
    ATen. Only the output is computed as ATen's: the three index outputs are for ATen's own
    backward, which is not used here."""
    if scale_grad_by_freq or mode == 2:
        raise NotImplementedError(
            "EmbeddingBag with mode='max' or scale_grad_by_freq=True has no compiled form here: use "
            "mode='sum' or 'mean', or fallback=True to keep PyTorch"
        )
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    bag = torch.bucketize(torch.arange(indices.shape[0], device=indices.device), offsets[:bags], right=True) - 1
    rows = weight[indices]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(1)
    kept = (indices != padding_idx) if padding_idx >= 0 else torch.ones_like(indices, dtype=torch.bool)
    count = torch.zeros(bags, dtype=torch.int64, device=indices.device).index_add(0, bag, kept.to(torch.int64))
    rows = torch.where(kept.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    out = torch.zeros(bags, weight.shape[1], dtype=rows.dtype, device=rows.device).index_add(0, bag, rows)
    if mode == 1:
        out = out / count.clamp_min(1).unsqueeze(1).to(out.dtype)
    return out, bag, count, count


def index_fill(x: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    """``index_fill`` as a ``where`` over the places the index names (negative ones counted from
    the end, as ATen's kernel does). torch's own decomposition writes the value expanded once per
    index (``index_copy``), so a 0-d value's gradient counted a repeated index twice; ATen's
    counts each filled place once."""
    n = x.shape[dim] if x.dim() else 1
    one = torch.ones((), dtype=torch.int32, device=x.device)
    hit = torch.zeros(n, dtype=torch.int32, device=x.device).index_put((index.reshape(-1),), one) != 0
    shape = [1] * x.dim()
    if x.dim():
        shape[dim] = n
    fill = value.to(x.dtype) if isinstance(value, torch.Tensor) else torch.scalar_tensor(value, dtype=x.dtype)
    return torch.where(hit.reshape(shape), fill.to(x.device), x)


def checked_index_write(decomposition: Callable) -> Callable:
    """``decomposition`` (of ``index_add``/``index_copy``) after ATen's own checks, which the
    decomposition leaves out: every index at least 0 (checked when the call runs: the
    decomposition writes through ``index_put``, which reads a negative index from the end, so a
    bad index would have been written to the wrong row instead of raising), and the source of
    the input's shape with the index's length along ``dim`` (checked at the trace: a smaller
    source was broadcast)."""

    def checked(x: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if x.dim() > 0:
            axis = dim % x.dim()
            torch._check(
                source.dim() == x.dim()
                and all(source.shape[d] == (index.numel() if d == axis else x.shape[d]) for d in range(x.dim())),
                lambda: (
                    f"source tensor shape must match self tensor shape, excluding the specified dimension. "
                    f"Got self.shape = {list(x.shape)} source.shape = {list(source.shape)}"
                ),
            )
        torch._assert_async(torch.all(index >= 0), "index out of range")
        return decomposition(x, dim, index, source, *args, **kwargs)

    return checked


def var_mean(x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> tuple:
    """``var_mean`` (a core op the default table leaves whole, no converter of its own) as the
    ``var`` and ``mean`` the converters take."""
    return aten.var.correction(x, dim, correction=correction, keepdim=keepdim), aten.mean.dim(x, dim, keepdim)


# ops whose decomposition here can lay its result out differently from the kernel the trace ran
# (``traced_layouts`` re-lays them out to the traced strides before decomposing)
LAYOUT_CHANGING = frozenset({aten.scaled_dot_product_attention.default})


def decomposition_table() -> dict:
    """torch.export's default table without the random ops and detach, with attention as ATen's math."""
    table = torch.export.default_decompositions()
    for op in list(table):
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            del table[op]
    # detach stays itself (the table makes it an alias): it is where the gradient stops
    table.pop(aten.detach.default, None)
    table[aten.scaled_dot_product_attention.default] = sdpa_math
    table[aten.hardswish.default] = hardswish_kinks
    table[aten._safe_softmax.default] = safe_softmax
    table[aten.hardsigmoid.default] = hardsigmoid_kinks
    table[aten.multilabel_margin_loss_forward.default] = multilabel_margin_loss
    # grid sampling as gathers (inductor's form): TVM's grid_sample has no gradient
    table.update(torch._decomp.get_decompositions([aten.grid_sampler_2d.default]))
    table[aten.var_mean.correction] = var_mean
    table[aten._embedding_bag.default] = embedding_bag
    table[aten._embedding_bag_forward_only.default] = embedding_bag
    table[aten.index_fill.int_Tensor] = index_fill
    table[aten.index_fill.int_Scalar] = index_fill
    for op in (aten.index_add.default, aten.index_copy.default):
        table[op] = checked_index_write(table[op])
    return table
