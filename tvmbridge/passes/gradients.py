"""Gradients that Relax 0.27 does not register and that BERT, GPT-2 and ViT blocks need.

Each goes into the bridge's own table (``GRADIENTS``) by the :func:`gradient` decorator; the
bridge's reverse sweep (``passes.reverse_mode``) looks there first, then at TVM's registry. Nothing
is registered with TVM: another user of ``relax.transform.Gradient`` in the process keeps TVM's
gradients. Every
formula is exact: no op is swapped for an approximation (exact GELU stays erf-based).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import tvm
from tvm import relax
from tvm.ir import Call
from tvm.relax import BlockBuilder, Expr, Var
from tvm.relax.op.grad import no_grad
from tvm.sym.analyzer import Analyzer

from analysis.registry import Registry

from ..errors import UnsupportedOpError

Gradient = Callable[[Var, Call, Var, BlockBuilder], list[Expr]]
GRADIENTS: Registry[str, Gradient] = Registry("gradient")  # Relax op name -> the bridge's gradient


def gradient(op_name: str) -> Callable[[Gradient], Gradient]:
    """Make the decorated function the bridge's gradient of Relax op ``op_name`` (once per op)."""
    return GRADIENTS.decorator(op_name)


def _dtype(expr: Expr) -> str:
    return str(expr.ty.dtype)


def _c(value: float, like: Expr) -> Expr:
    return relax.const(value, _dtype(like))


@gradient("relax.grad.no_grad")
def no_grad_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``no_grad`` marks a value whose gradient is not wanted (outputs that get none, such as
    updated running statistics, and the forward of ``padding_idx`` rows): nothing flows back."""
    return [no_grad(orig_call.args[0])]


@gradient("relax.nn.gelu")
def gelu_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """y = x * Phi(x); dy/dx = Phi(x) + x * phi(x), Phi(x) = (1 + erf(x/sqrt2))/2,
    phi(x) = exp(-x^2/2)/sqrt(2 pi)."""
    x = orig_call.args[0]
    op = relax.op
    cdf = op.multiply(_c(0.5, x), op.add(_c(1.0, x), op.erf(op.multiply(x, _c(1 / math.sqrt(2), x)))))
    pdf = op.multiply(
        _c(1 / math.sqrt(2 * math.pi), x),
        op.exp(op.multiply(_c(-0.5, x), op.multiply(x, x))),
    )
    return [op.multiply(output_grad, op.add(cdf, op.multiply(x, pdf)))]


@gradient("relax.nn.gelu_tanh")
def gelu_tanh_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """y = x/2 (1 + tanh(u)), u = k (x + 0.044715 x^3), k = sqrt(2/pi);
    dy/dx = (1 + t)/2 + x/2 (1 - t^2) k (1 + 3*0.044715 x^2)."""
    x = orig_call.args[0]
    op = relax.op
    k = math.sqrt(2 / math.pi)
    x2 = op.multiply(x, x)
    u = op.multiply(_c(k, x), op.add(x, op.multiply(_c(0.044715, x), op.multiply(x2, x))))
    t = op.tanh(u)
    du = op.multiply(_c(k, x), op.add(_c(1.0, x), op.multiply(_c(3 * 0.044715, x), x2)))
    left = op.multiply(_c(0.5, x), op.add(_c(1.0, x), t))
    right = op.multiply(op.multiply(_c(0.5, x), x), op.multiply(op.subtract(_c(1.0, x), op.multiply(t, t)), du))
    return [op.multiply(output_grad, op.add(left, right))]


@gradient("relax.erf")
def erf_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """d erf(x)/dx = 2/sqrt(pi) exp(-x^2)."""
    x = orig_call.args[0]
    op = relax.op
    d = op.multiply(_c(2 / math.sqrt(math.pi), x), op.exp(op.negative(op.multiply(x, x))))
    return [op.multiply(output_grad, d)]


@gradient("relax.rsqrt")
def rsqrt_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """y = x^-1/2; dy/dx = -y^3/2."""
    op = relax.op
    y = orig_var
    return [op.multiply(output_grad, op.multiply(_c(-0.5, y), op.multiply(y, op.multiply(y, y))))]


@gradient("relax.mean")
def mean_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """The output gradient spread over the reduced axes, divided by their element count; a count
    over symbolic axes (a loss averaged over a sequence of any length) is read from the shape at
    run time, where Relax's own gradient needs it static."""
    op = relax.op
    x = orig_call.args[0]
    shape = list(x.ty.shape)
    axes = range(len(shape)) if orig_call.attrs.axis is None else [int(a) % len(shape) for a in orig_call.attrs.axis]
    count = math.prod([shape[a] for a in axes]) if axes else 1
    if _static(count) is not None:
        divisor = relax.const(_static(count), _dtype(output_grad))
    else:
        divisor = op.astype(op.reshape(op.shape_to_tensor(relax.ShapeExpr([count])), ()), _dtype(output_grad))
    grad = op.divide(output_grad, divisor)
    if not orig_call.attrs.keepdims and axes:
        grad = op.reshape(grad, [1 if i in axes else d for i, d in enumerate(shape)])
    return [op.broadcast_to(grad, x.ty.shape)]


@gradient("relax.squeeze")
def squeeze_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """squeeze only drops size-1 axes: the gradient is a reshape back."""
    return [relax.op.reshape(output_grad, orig_call.args[0].ty.shape)]


def _ints(expr: Expr) -> list[int]:
    """Integers of a Relax tuple of PrimValues/IntImms (how strided_slice holds axes and bounds)."""
    fields = expr.fields if hasattr(expr, "fields") else expr
    return [int(getattr(f, "value", f)) for f in fields]


@gradient("relax.strided_slice")
def strided_slice_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Pad the gradient with zeros back to the input's extent, one sliced axis at a time (a
    stepped slice's gradient spread ``step`` apart first); the bounds follow Python slicing
    (negative begins wrap, ends clip). A unit-step slice along a symbolic axis (the last
    ``window`` positions of a sequence of any length) is padded by concatenating zeros whose
    extent is symbolic; the frontend emits such slices in bounds (``assume_inbound``)."""
    op = relax.op
    x = orig_call.args[0]
    ndim = len(x.ty.shape)
    axes = _ints(orig_call.args[1])
    begins = _prims(orig_call.args[2])
    strides = _ints(orig_call.args[4]) if len(orig_call.args) > 4 else [1] * len(axes)
    grad: Expr = output_grad
    cur = list(orig_var.ty.shape)
    for axis, b, s in zip(axes, begins, strides):
        axis = axis % ndim
        n, length = _static(x.ty.shape[axis]), _static(cur[axis])
        if n is None or length is None or not isinstance(b, int):
            if s != 1 or not orig_call.attrs.assume_inbound:
                raise NotImplementedError("gradient of a stepped or unchecked slice along a symbolic axis")
            grad = _pad_symbolic(grad, cur, axis, b, x.ty.shape[axis])
            cur[axis] = x.ty.shape[axis]
            continue
        if s < 1:
            raise NotImplementedError("gradient of a slice with a negative step")
        b = b + n if b < 0 else b
        b = min(max(b, 0), n)
        if s > 1 and length > 0:  # every s-th element read: the gradient spread s apart
            grad, length = _spread(grad, cur, axis, s, n - b), min(length * s, n - b)
        widths = [0] * (2 * ndim)
        widths[2 * axis], widths[2 * axis + 1] = b, n - b - length
        if any(widths):
            grad = op.nn.pad(grad, widths)
        cur[axis] = n
    return [grad] + [no_grad(a) for a in orig_call.args[1:]]


def _prims(expr: Expr) -> list:
    """A Relax tuple of sizes as ints where static, TIR expressions where symbolic."""
    fields = expr.fields if hasattr(expr, "fields") else expr
    return [_static(f) if _static(f) is not None else f for f in fields]


def _pad_symbolic(grad: Expr, shape: list, axis: int, begin: Any, size: Any) -> Expr:
    """``grad`` (``shape``) between zeros to ``size`` along ``axis``: ``begin`` zeros before (a
    negative begin counts from the end) and the rest after, either of them symbolic."""
    op = relax.op
    simplify = Analyzer().simplify
    begin = simplify(begin + size if isinstance(begin, int) and begin < 0 else begin)
    after = simplify(size - begin - shape[axis])
    parts = []
    for extent, part in ((begin, None), (None, grad), (after, None)):
        if part is not None:
            parts.append(part)
        elif _static(extent) != 0:
            parts.append(op.zeros(relax.ShapeExpr([*shape[:axis], extent, *shape[axis + 1 :]]), _dtype(grad)))
    return parts[0] if len(parts) == 1 else op.concat(parts, axis=axis)


def _static(d: Any) -> int | None:
    return int(d) if isinstance(d, (int, tvm.tirx.IntImm)) else None


def _spread(grad: Expr, dims: list[Any], axis: int, step: int, room: int) -> Expr:
    """``grad`` with ``step - 1`` zeros after each element along ``axis`` (a size-1 axis padded to
    ``step`` and folded in), cut to at most ``room`` elements. ``dims[axis]`` is static (the
    caller's check); the other sizes may be symbolic (rotary embeddings' ``x[..., ::2]`` over a
    batch and sequence of any size)."""
    op = relax.op
    shape: list[Any] = [_static(d) if _static(d) is not None else d for d in dims]
    length = _static(dims[axis])
    assert length is not None, "a stepped slice's own axis is static"
    expanded = shape[: axis + 1] + [1] + shape[axis + 1 :]
    pads = [0] * (2 * len(expanded))
    pads[2 * (axis + 1) + 1] = step - 1
    wide = shape[:axis] + [length * step] + shape[axis + 1 :]
    spread = op.reshape(op.nn.pad(op.reshape(grad, expanded), pads), wide)
    if length * step > room:
        spread = op.strided_slice(spread, [axis], [0], [room])
    return spread


@gradient("relax.gather_elements")
def gather_elements_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """y[i][j] = x[i][index[i][j]] (along ``axis``): each output's gradient is added back at the
    element it was read from, repeats summed (``scatter_elements`` with ``add``). This is the
    backward of ``gather`` and so of ``cross_entropy``/``nll_loss`` with class indices."""
    x, index = orig_call.args[0], orig_call.args[1]
    axis = int(orig_call.attrs.axis) % len(x.ty.shape)
    picked, extent = _static(index.ty.shape[axis]), _static(x.ty.shape[axis])
    if picked == 1 and extent is not None and _rows_match(index, x, axis):  # a loss's target class per row
        return [_select_at(index, output_grad, axis, extent, _dtype(x)), no_grad(index)]
    zeros = relax.op.zeros_like(x)
    return [relax.op.scatter_elements(zeros, index, output_grad, axis=axis, reduction="add"), no_grad(index)]


def _rows_match(index: Expr, x: Expr, axis: int) -> bool:
    """Whether ``index`` provably has ``x``'s size in every dim but ``axis`` (a gather may read a
    smaller block; and the labels of a symbolic loss have sizes of their own, equal to the logits'
    rows only at run time): only then is the ``where`` of :func:`_select_at` ``x``'s shape."""
    analyzer = Analyzer()
    return all(d == axis or analyzer.can_prove_equal(i, n) for d, (i, n) in enumerate(zip(index.ty.shape, x.ty.shape)))


def _select_at(index: Expr, values: Expr, axis: int, extent: int, dtype: str) -> Expr:
    """``scatter_elements(zeros, index, values, axis, "add")`` where ``index`` has one element
    along ``axis`` (no place is written twice): ``where(position == index, values, 0)``, which is
    elementwise, so it fuses into the kernels that read it instead of filling and scattering a
    whole (rows, vocabulary) tensor first."""
    op = relax.op
    ndim = len(index.ty.shape)
    positions = op.reshape(op.arange(0, extent, dtype=_dtype(index)), [extent if i == axis else 1 for i in range(ndim)])
    return op.where(op.equal(positions, index), values, relax.const(0, dtype))


def _extent(n: Any) -> Expr:
    """An axis size as an int64 tensor of shape (1,) (a symbolic size through ``shape_to_tensor``)."""
    if isinstance(n, (int, tvm.tirx.IntImm)):
        return relax.const([int(n)], "int64")
    return relax.op.shape_to_tensor(relax.ShapeExpr([n]))


@gradient("relax.take")
def take_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """y = take(x, index, axis): every read row's gradient is added back at the row it came from
    (embeddings: the scatter-add backward). Relax's own ``take_backward`` only lowers 1-D indices
    (a 0-d index, ``x[:, 0]``, fails an assert in the build), so any index rank is flattened to
    1-D and the axis moved first for ``scatter_nd(add)``. Indices are normalised as the forward
    read them (negative ones wrap, ``clip`` clips, ``wrap`` wraps)."""
    op = relax.op
    x, index = orig_call.args[0], orig_call.args[1]
    shape = list(x.ty.shape)
    ndim = len(shape)
    axis = int(orig_call.attrs.axis) % ndim
    n = shape[axis]
    idx = op.astype(op.reshape(index, [-1]), "int64")
    extent = _extent(n)
    if str(orig_call.attrs.mode) == "wrap":
        idx = op.floor_mod(idx, extent)
    else:
        idx = op.where(op.less(idx, relax.const(0, "int64")), op.add(idx, extent), idx)
        idx = op.clip(idx, relax.prim_value(0), relax.prim_value(n - 1))
    count = 1
    for d in index.ty.shape:
        count = count * d
    others = [*shape[:axis], *shape[axis + 1 :]]
    if not isinstance(count, (int, tvm.tirx.IntImm)) and all(isinstance(d, (int, tvm.tirx.IntImm)) for d in others):
        count = -1  # one symbolic axis: let reshape infer it
    grad_shape = [*shape[:axis], count, *shape[axis + 1 :]]
    order = [axis, *[i for i in range(ndim) if i != axis]]
    back = [order.index(i) for i in range(ndim)]
    grad = op.permute_dims(op.reshape(output_grad, grad_shape), order)
    zeros = op.zeros([shape[i] for i in order], _dtype(x))
    summed = op.scatter_nd(zeros, op.expand_dims(idx, 1), grad, reduction="add")
    return [op.permute_dims(summed, back), no_grad(index)]


@gradient("relax.topk")
def topk_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """The k values' gradients go back to the places they were read from, as PyTorch's
    ``topk`` backward scatters them (mixture-of-experts routers take the top experts' weights);
    the indices get none."""
    x, attrs = orig_call.args[0], orig_call.attrs
    axis, kind = int(attrs.axis), str(attrs.ret_type)
    if kind == "indices":
        return [relax.op.zeros_like(x)]
    values_grad = ctx.normalize(relax.TupleGetItem(output_grad, 0)) if kind == "both" else output_grad
    # the places taken again (the capture set keeps tensors, not the forward's tuple)
    index = ctx.normalize(relax.op.topk(x, int(attrs.k), axis, "indices", bool(attrs.largest), "int64"))
    zeros = relax.op.zeros_like(x)
    return [relax.op.scatter_elements(zeros, index, values_grad, axis=axis, reduction="add")]


@gradient("relax.scatter_elements")
def scatter_elements_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``x.scatter(axis, index, src)`` (``reduction`` update or add): ``src`` gets the gradient of
    the places it was written to (every repeat, as PyTorch's ``gather`` backward gives it);
    ``x`` keeps its gradient except where overwritten."""
    x, index, updates = orig_call.args
    axis, reduction = int(orig_call.attrs.axis), str(orig_call.attrs.reduction)
    if reduction not in ("update", "add"):
        raise UnsupportedOpError("gradient", f"scatter with reduction {reduction!r}", op="relax.scatter_elements")
    op = relax.op
    x_grad = output_grad
    if reduction == "update":
        x_grad = op.scatter_elements(output_grad, index, op.zeros_like(updates), axis=axis, reduction="update")
    return [x_grad, no_grad(index), op.gather_elements(output_grad, index, axis=axis)]


@gradient("relax.scatter_nd")
def scatter_nd_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``x[idx] = v`` (``update``) or ``x[idx] += v`` (``add``): ``v`` gets the gradient read at
    its places (repeats each get it, as PyTorch's ``index_put`` backward); ``x`` keeps its
    gradient except where overwritten."""
    x, index, updates = orig_call.args
    reduction = str(orig_call.attrs.reduction)
    if reduction not in ("update", "add"):
        raise UnsupportedOpError("gradient", f"scatter_nd with reduction {reduction!r}", op="relax.scatter_nd")
    op = relax.op
    x_grad = output_grad
    if reduction == "update":
        x_grad = op.scatter_nd(output_grad, index, op.zeros_like(updates), reduction="update")
    return [x_grad, no_grad(index), op.gather_nd(output_grad, index)]
