"""FLOP formulas per aten op and their registry: what one executed op costs, the counter's
rule book (``flops.FlopCounter`` adds these up per module and phase).

Convention: a multiply-add is 2 FLOPs (the convention of ``torch.utils.flop_counter``, whose
formula registry is reused as is for what it covers: mm, addmm, bmm, baddbmm, convolution and its
backward, attention kernels). PyTorch counts every other op as zero; here they get a count too:

* pointwise arithmetic (ops tagged ``torch.Tag.pointwise``): 1 FLOP per output element per
  elementary operation (``+ - * /``, compare, ``exp``, ``erf``, ``tanh``... each count 1), so most
  are 1 per element; composite activations count the operations of their textbook formula
  (``_POINTWISE_COST``). Copies, casts and selects (``clone``, ``where``, ``masked_fill``) are 0.
* reductions (``torch.Tag.reduction``): 1 per input element (``var``/``std``: 3).
* softmax 5 (``_softmax`` and the math SDPA's ``_safe_softmax``), its backward 4, log-softmax 5
  and 3 per element; layer/batch norm 5 per element to normalise plus 1 each for the affine
  weight and bias, backward 8 per element for the input gradient and 2/1 for weight/bias;
  pooling 1 per window element; embedding backward 1 per gradient element (scatter-add).

The counts that only this module makes are estimates of work, not measurements: they are stated
so that totals are comparable between models, not to be exact to the instruction.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry as _torch_flop_registry

from analysis.registry import Registry
from analysis.tensors import tensor_leaves

aten = torch.ops.aten

# A formula gets the op's args, kwargs and output (real, fake or meta tensors) and returns FLOPs.
RawFormula = Callable[[tuple[Any, ...], dict[str, Any], Any], int]

# op packet or overload -> formula: the built-in rules below, then the user's (which replace them)
_EXTRA_FORMULAS: Registry[Any, RawFormula] = Registry("flop formula")


def register_flop_formula(targets: Any, formula: RawFormula | None = None) -> Any:
    """Register ``formula(args, kwargs, out) -> int`` for one op packet or a list of them.

    Usable as a decorator. Overrides the built-in rules of this module (not PyTorch's registry,
    which stays untouched so that ``torch.utils.flop_counter.FlopCounterMode`` keeps its meaning).
    """

    def register(f: RawFormula) -> RawFormula:
        for t in targets if isinstance(targets, (list, tuple)) else [targets]:
            if not isinstance(t, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
                raise TypeError(f"register_flop_formula: expected an aten op packet, got {t!r}")
            _EXTRA_FORMULAS[t] = f
        formula_for.cache_clear()
        return f

    return register if formula is None else register(formula)


def _numel(x: Any) -> int:
    return sum(t.numel() for t in tensor_leaves(x))


def _first_numel(args: tuple[Any, ...]) -> int:
    ts = tensor_leaves(args)
    return ts[0].numel() if ts else 0


# --- pointwise ---------------------------------------------------------------------------------
_ZERO_COST = {
    aten.clone,
    aten.where,
    aten.masked_fill,
    aten.masked_fill_,
    aten._to_copy,
    aten.copy,
    aten.copy_,
    aten.fill,
    aten.fill_,
    aten.zero_,
    aten.lift_fresh_copy,
    aten.alias,
    aten.bernoulli,
    aten.bernoulli_,
    aten.zeros_like,
    aten.ones_like,
    aten.empty_like,
}
_POINTWISE_COST: dict[Any, int] = {
    aten.gelu: 5,  # x * 0.5 * (1 + erf(x / sqrt 2))
    aten.gelu_backward: 9,  # g * (cdf + x * pdf): cdf 4, pdf 3 (square, scale, exp), 2 mul/add
    aten.sigmoid: 4,
    aten.sigmoid_backward: 3,  # g * y * (1 - y)
    aten.tanh_backward: 3,  # g * (1 - y * y)
    aten.silu: 5,
    aten.silu_backward: 8,
    aten.addcmul: 2,
    aten.addcmul_: 2,
    aten.addcdiv: 2,
    aten.addcdiv_: 2,
    aten.lerp: 3,
    aten.lerp_: 3,
}


def _pointwise(cost: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    return cost * _numel(out)


# --- specific formulas ------------------------------------------------------------------------
def _per_input_element(cost: int) -> RawFormula:
    return lambda args, kwargs, out: cost * _first_numel(args)


def _per_output_element(cost: int) -> RawFormula:
    return lambda args, kwargs, out: cost * _numel(out if not isinstance(out, tuple) else out[0])


def _mean(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    return _first_numel(args) + _numel(out)  # sum, then one division per result


def _norm_forward(x: torch.Tensor, weight: Any, bias: Any) -> int:
    n = x.numel()
    return 5 * n + (n if weight is not None else 0) + (n if bias is not None else 0)


def _layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    x, _shape, weight, bias = (list(args) + [None, None, None])[:4]
    return _norm_forward(x, weight, bias)


def _batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    x, weight, bias = args[0], args[1], args[2]
    training = kwargs.get("training", args[5] if len(args) > 5 and isinstance(args[5], bool) else True)
    if not training:  # (x - mean) * invstd with stored statistics
        n = x.numel()
        return 2 * n + (n if weight is not None else 0) + (n if bias is not None else 0)
    return _norm_forward(x, weight, bias)


def _norm_backward(n: int, mask: list[bool]) -> int:
    return (8 * n if mask[0] else 0) + (2 * n if mask[1] else 0) + (n if mask[2] else 0)


def _layer_norm_backward(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    mask = kwargs.get("output_mask", args[7] if len(args) > 7 else [True, True, True])
    return _norm_backward(args[0].numel(), list(mask))


def _batch_norm_backward(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    mask = kwargs.get("output_mask", args[-1] if isinstance(args[-1], (list, tuple)) else [True] * 3)
    return _norm_backward(args[0].numel(), list(mask))


def _pool(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    kernel = args[1] if len(args) > 1 else kwargs["kernel_size"]
    o = out[0] if isinstance(out, tuple) else out
    return o.numel() * math.prod(kernel)


def _var(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    return 3 * _first_numel(args)


for _packet, _formula in {
    aten._softmax: _per_output_element(5),
    # the math SDPA's softmax (fully masked rows give 0, not NaN). Its backward is the plain
    # ``_softmax_backward_data`` (4 per element), so the forward counts as a softmax too: PyTorch
    # counts neither, and counting only the backward would make a layer's backward/forward ratio
    # depend on the attention kernel. Zeroing masked rows is a select, which costs 0 here.
    aten._safe_softmax: _per_output_element(5),
    aten._softmax_backward_data: _per_output_element(4),
    aten._log_softmax: _per_output_element(5),
    aten._log_softmax_backward_data: _per_output_element(3),
    aten.native_layer_norm: _layer_norm,
    aten.native_layer_norm_backward: _layer_norm_backward,
    aten.native_batch_norm: _batch_norm,
    aten._native_batch_norm_legit: _batch_norm,
    aten._native_batch_norm_legit_functional: _batch_norm,
    aten._native_batch_norm_legit_no_training: lambda a, k, o: _batch_norm(a[:5] + (False,), {}, o),
    aten.native_batch_norm_backward: _batch_norm_backward,
    aten.max_pool2d_with_indices: _pool,
    aten.max_pool3d_with_indices: _pool,
    aten.avg_pool2d: _pool,
    aten.avg_pool3d: _pool,
    aten.max_pool2d_with_indices_backward: _per_input_element(1),
    aten.avg_pool2d_backward: _per_input_element(1),
    aten._adaptive_avg_pool2d: _per_input_element(1),
    aten._adaptive_avg_pool2d_backward: _per_input_element(1),
    aten.embedding_dense_backward: _per_input_element(1),
    aten.mean: _mean,
    aten.var: _var,
    aten.std: _var,
    aten.var_mean: _var,
    aten.std_mean: _var,
}.items():
    _EXTRA_FORMULAS[_packet] = _formula


def _wrap_torch_formula(f: Callable[..., int]) -> RawFormula:
    return lambda args, kwargs, out: int(f(*args, **kwargs, out_val=out))


@functools.lru_cache(maxsize=4096)
def formula_for(func: Any) -> RawFormula | None:
    """The formula counting ``func`` (an OpOverload), or None when the op costs nothing."""
    packet = getattr(func, "_overloadpacket", func)
    f: RawFormula | None
    if func in _EXTRA_FORMULAS:
        f = _EXTRA_FORMULAS[func]
    elif packet in _EXTRA_FORMULAS:
        f = _EXTRA_FORMULAS[packet]
    elif packet in _torch_flop_registry:
        f = _wrap_torch_formula(_torch_flop_registry[packet])
    elif packet in _ZERO_COST:
        f = None
    elif torch.Tag.pointwise in getattr(func, "tags", ()):
        f = partial(_pointwise, _POINTWISE_COST.get(packet, 1))
    elif torch.Tag.reduction in getattr(func, "tags", ()):
        f = _per_input_element(1)
    else:
        f = None
    return f


def count_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one executed aten op."""
    f = formula_for(func)
    return 0 if f is None else f(args, kwargs, out)


def is_torch_counted(packet: Any) -> bool:
    """True for ops PyTorch's own FlopCounterMode counts (the ones our totals must equal)."""
    return packet in _torch_flop_registry
