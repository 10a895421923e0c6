"""Gradients of the elementwise, reduction and layout ops Relax 0.27 lacks, and fixes where
Relax's own is wrong (convolutions, normalization and pooling are in ``gradients_conv``).

Registered on import (``passes.gradient`` imports this module) through ``gradients.gradient``, at
the bridge's level, above Relax's. Every formula is PyTorch's autograd formula, down to what
happens at ties and at the kinks (``relu`` and ``abs`` at 0, ``maximum`` of equal values, a value
on a ``clamp`` bound): those are where Relax's own gradients differ from PyTorch's, so they are
replaced here. A case a formula does not cover raises, which the gradient stage reports as an
``UnsupportedOpError`` naming the op: never an approximate number.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.ir import Call
from tvm.relax import BlockBuilder, Expr, Var
from tvm.relax.op.grad import no_grad

from .gradient_exprs import const, dtype_of, emit, fit_shape, scalar, sizes_of
from .gradients import gradient

op = relax.op


# --- elementwise ------------------------------------------------------------------------------
@gradient("relax.clip")
def clip_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """PyTorch's ``clamp`` backward: the gradient passes where ``min <= x <= max`` (bounds
    included), nowhere else (NaN included). ``hardtanh``, which excludes its bounds, is converted
    without ``clip`` (``frontend/converters/elementwise.py``)."""
    x = orig_call.args[0]
    if not dtype_of(x).startswith(("float", "bfloat")):  # an integer clamp on the way to a float
        return [no_grad(a) for a in orig_call.args]
    lo, hi = scalar(orig_call.args[1]), scalar(orig_call.args[2])
    inside = op.logical_and(op.greater_equal(x, const(lo, x)), op.less_equal(x, const(hi, x)))
    return [op.where(inside, output_grad, const(0.0, x)), no_grad(orig_call.args[1]), no_grad(orig_call.args[2])]


@gradient("relax.nn.leakyrelu")
def leakyrelu_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``g`` where ``x > 0``, ``g * slope`` elsewhere (at 0 too), as ``leaky_relu_backward``."""
    x = orig_call.args[0]
    slope = const(float(orig_call.attrs.alpha), x)
    return [op.where(op.greater(x, const(0.0, x)), output_grad, op.multiply(output_grad, slope))]


@gradient("relax.where")
def where_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Each branch gets the gradient where it was chosen, summed down to its own shape: Relax's
    own returns it at the output's shape, and a broadcast branch (``where(mask, x[:, None], 0)``,
    ``diag_embed``) then receives a silently wrong gradient."""
    cond, a, b = orig_call.args
    ga = emit(ctx, op.where(cond, output_grad, const(0.0, a)))
    gb = emit(ctx, op.where(cond, const(0.0, b), output_grad))
    return [no_grad(cond), fit_shape(ga, a), fit_shape(gb, b)]


@gradient("relax.nn.relu")
def relu_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``g`` where ``x > 0``: 0 at ``x == 0`` as PyTorch (Relax's own passes ``g`` there)."""
    x = orig_call.args[0]
    return [op.where(op.greater(x, const(0.0, x)), output_grad, const(0.0, x))]


@gradient("relax.nn.relu6")
def relu6_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``hardtanh(x, 0, 6)``'s: ``g`` strictly inside the bounds."""
    x = orig_call.args[0]
    inside = op.logical_and(op.greater(x, const(0.0, x)), op.less(x, const(6.0, x)))
    return [op.where(inside, output_grad, const(0.0, x))]


@gradient("relax.abs")
def abs_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``g * sign(x)``: 0 at ``x == 0`` as PyTorch (Relax's own passes ``g`` there)."""
    return [op.multiply(output_grad, op.sign(orig_call.args[0]))]


def tie_split(output_grad: Expr, mine: Expr, other: Expr, loses: Expr) -> Expr:
    """PyTorch's ``maximum``/``minimum`` backward for one side: half at ties, nothing where this
    side ``loses``, the whole gradient elsewhere (NaNs included)."""
    half = op.divide(output_grad, const(2.0, output_grad))
    kept = op.where(op.equal(mine, other), half, output_grad)
    return op.where(loses, const(0.0, output_grad), kept)


@gradient("relax.maximum")
def maximum_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Ties split the gradient in halves (Relax's own gives it all to the first argument)."""
    x, y = orig_call.args
    return [
        fit_shape(emit(ctx, tie_split(output_grad, x, y, op.less(x, y))), x),
        fit_shape(emit(ctx, tie_split(output_grad, y, x, op.less(y, x))), y),
    ]


@gradient("relax.minimum")
def minimum_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Ties split the gradient in halves (Relax's own gives it all to the first argument)."""
    x, y = orig_call.args
    return [
        fit_shape(emit(ctx, tie_split(output_grad, x, y, op.greater(x, y))), x),
        fit_shape(emit(ctx, tie_split(output_grad, y, x, op.greater(y, x))), y),
    ]


@gradient("relax.sign")
@gradient("relax.floor")
@gradient("relax.ceil")
@gradient("relax.round")
@gradient("relax.trunc")
def zero_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Piecewise-constant ops: zero almost everywhere, which is what PyTorch returns."""
    x = orig_call.args[0]
    return [op.zeros(x.ty.shape, dtype_of(x))]


@gradient("relax.arange")
def arange_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """A constant range (index arithmetic of decomposed interpolations): nothing to pass back."""
    return [no_grad(a) for a in orig_call.args]


# --- elementwise functions Relax has no gradient for: PyTorch's derivatives.yaml formulas -------
def unary(fn: Callable[[Expr, Expr, Expr], Expr]) -> Callable:
    """A gradient ``[fn(x, y, g)]`` for a one-input op (``y`` its output)."""

    def grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
        return [fn(orig_call.args[0], orig_var, output_grad)]

    return grad


def one_minus_square(x: Expr) -> Expr:
    return op.subtract(const(1.0, x), op.multiply(x, x))


gradient("relax.asin")(unary(lambda x, y, g: op.multiply(g, op.rsqrt(one_minus_square(x)))))
gradient("relax.acos")(unary(lambda x, y, g: op.negative(op.multiply(g, op.rsqrt(one_minus_square(x))))))
gradient("relax.atan")(unary(lambda x, y, g: op.divide(g, op.add(op.multiply(x, x), const(1.0, x)))))


def exp_halves(x: Expr, sign: float) -> Expr:
    """``(e^x + sign * e^-x) / 2``: cosh (sign 1) and sinh (sign -1) written out, since LLVM
    codegen has no ``tirx.cosh`` intrinsic."""
    return op.multiply(op.add(op.exp(x), op.multiply(const(sign, x), op.exp(op.negative(x)))), const(0.5, x))


gradient("relax.sinh")(unary(lambda x, y, g: op.multiply(g, exp_halves(x, 1.0))))
gradient("relax.cosh")(unary(lambda x, y, g: op.multiply(g, exp_halves(x, -1.0))))
gradient("relax.tan")(unary(lambda x, y, g: op.multiply(g, op.add(const(1.0, y), op.multiply(y, y)))))
gradient("relax.asinh")(unary(lambda x, y, g: op.multiply(g, op.rsqrt(op.add(op.multiply(x, x), const(1.0, x))))))
gradient("relax.acosh")(unary(lambda x, y, g: op.multiply(g, op.rsqrt(op.subtract(op.multiply(x, x), const(1.0, x))))))
gradient("relax.atanh")(unary(lambda x, y, g: op.divide(g, one_minus_square(x))))


@gradient("relax.atan2")
def atan2_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``atan2(y, x)``: ``g * x / r``, ``-g * y / r`` with ``r = x^2 + y^2``, each summed to its shape."""
    y, x = orig_call.args
    recip = op.divide(const(1.0, y), op.add(op.multiply(y, y), op.multiply(x, x)))
    gy = emit(ctx, op.multiply(op.multiply(output_grad, x), recip))
    gx = emit(ctx, op.multiply(op.multiply(output_grad, op.negative(y)), recip))
    return [fit_shape(gy, y), fit_shape(gx, x)]


def remainder_grad(rounded: Callable[[Expr, Expr], Expr]) -> Callable:
    """``x - q * y`` with ``q = rounded(x / y)`` piecewise constant: ``g`` and ``-g * q``."""

    def grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
        x, y = orig_call.args
        q = rounded(op.divide(x, y), x)
        gy = emit(ctx, op.negative(op.multiply(output_grad, q)))
        return [fit_shape(emit(ctx, output_grad), x), fit_shape(gy, y)]

    return grad


gradient("relax.floor_mod")(remainder_grad(lambda q, x: op.floor(q)))  # remainder, %
gradient("relax.mod")(remainder_grad(lambda q, x: op.trunc(q)))  # fmod


@gradient("relax.floor_divide")
def floor_divide_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Piecewise constant in both arguments: zero gradients, as PyTorch."""
    return [op.zeros(a.ty.shape, dtype_of(a)) for a in orig_call.args]


@gradient("relax.logical_not")
@gradient("relax.argmax")
@gradient("relax.argmin")
def no_gradient(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Boolean and index results: nothing flows back (Relax asks when a float input reaches one)."""
    return [no_grad(a) for a in orig_call.args]


# --- reductions ---------------------------------------------------------------------------------
def kept_dims(x: Expr, axis: list[int] | None) -> tuple[list, list[int]]:
    """The shape of a reduction over ``axis`` with ``keepdims`` (the reduced dims 1), and the
    reduced axes as non-negative ints."""
    ndim = len(x.ty.shape)
    axes = list(range(ndim)) if axis is None else sorted(int(a) % ndim for a in axis)
    return [1 if i in axes else d for i, d in enumerate(x.ty.shape)], axes


@gradient("relax.max")
@gradient("relax.min")
def extreme_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``amax``/``amin`` (and full ``max()``/``min()``): the gradient shared evenly among the
    elements equal to the result, ``(g / count) * mask``, as PyTorch's ``scale_grad_by_count``."""
    x = orig_call.args[0]
    axis = orig_call.attrs.axis
    shape, axes = kept_dims(x, None if axis is None else list(axis))
    y, g = orig_var, output_grad
    if not orig_call.attrs.keepdims:
        y, g = op.reshape(y, shape), op.reshape(g, shape)
    mask = op.astype(op.equal(x, y), dtype_of(x))
    count = op.sum(mask, axes, keepdims=True)
    return [op.multiply(op.divide(g, count), mask)]


@gradient("relax.prod")
def prod_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``prod`` over one axis: each element's gradient is the product of the others, as the
    exclusive running products from both ends (no division: exact where an element is 0, as
    PyTorch's ``prod_backward``)."""
    x, axis = orig_call.args[0], orig_call.attrs.axis
    if axis is None or len(axis) != 1:
        raise NotImplementedError("prod over several axes at once (the bridge converts one axis at a time)")
    a = int(axis[0]) % len(x.ty.shape)
    g = output_grad if orig_call.attrs.keepdims else op.expand_dims(output_grad, a)
    before = op.cumprod(x, axis=a, exclusive=True)
    after = op.flip(op.cumprod(op.flip(x, a), axis=a, exclusive=True), a)
    return [op.multiply(g, op.multiply(before, after))]


# --- layout -------------------------------------------------------------------------------------
@gradient("relax.flip")
def flip_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Flipping is its own inverse."""
    return [op.flip(output_grad, int(orig_call.attrs.axis))]


@gradient("relax.tile")
def tile_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Every copy adds up: the gradient viewed as ``(r0, s0, r1, s1, ...)`` summed over the
    ``r`` axes (``tile`` first pads the shorter of shape and repeats with leading 1s); the
    sizes may be symbolic (a batch of any size tiled)."""
    x = orig_call.args[0]
    dims = sizes_of(x, "relax.tile")
    reps = [int(r) for r in orig_call.attrs.repeats]
    n = max(len(dims), len(reps))
    dims, reps = [1] * (n - len(dims)) + dims, [1] * (n - len(reps)) + reps
    interleaved = [v for pair in zip(reps, dims) for v in pair]
    summed = op.sum(op.reshape(output_grad, interleaved), axis=list(range(0, 2 * n, 2)))
    return [op.reshape(summed, x.ty.shape)]


@gradient("relax.split")
def split_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """The parts' gradients concatenated back, empty parts left out; a split into one section
    (``torch.split(x, 5)`` of an axis of 5) is a tensor, not a tuple, which Relax's own gradient
    hands to ``concat`` (the module was refused)."""
    rest = [no_grad(a) for a in orig_call.args[1:]]
    if isinstance(orig_var.ty, relax.TensorType):  # one section: the split is the tensor itself
        return [output_grad] + rest
    axis = int(orig_call.attrs.axis)
    keep = [
        i
        for i, f in enumerate(orig_var.ty.fields)
        if not any(isinstance(getattr(d, "value", None), int) and d.value == 0 for d in f.shape)
    ]
    parts = [emit(ctx, relax.TupleGetItem(output_grad, i)) for i in keep]
    return [parts[0] if len(parts) == 1 else op.concat(parts, axis)] + rest


@gradient("relax.nn.pad")
def pad_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """Constant padding: the gradient of the input is the un-padded window (the pad value gets
    none: it is a constant here). Edge and reflect padding sum several outputs into one input:
    not written yet, refused."""
    mode = str(orig_call.attrs.pad_mode)
    if mode != "constant":
        raise NotImplementedError(f"the gradient of relax.nn.pad with pad_mode={mode} (only constant)")
    x = orig_call.args[0]
    shape = list(x.ty.shape)
    widths = [int(w) for w in orig_call.attrs.pad_width]
    if any(w < 0 for w in widths):
        raise NotImplementedError("the gradient of relax.nn.pad with negative pad widths")
    # only the padded axes are sliced; a size may be symbolic (a batch, a sequence's length: the
    # window padding of ConvBERT's unfold), the slice then ends at an expression, in bounds
    axes = [i for i in range(len(shape)) if widths[2 * i] or widths[2 * i + 1]]
    ends = [widths[2 * i] + (int(shape[i]) if isinstance(shape[i], tvm.tirx.IntImm) else shape[i]) for i in axes]
    symbolic = not all(isinstance(e, int) for e in ends)
    grad = (
        op.strided_slice(output_grad, axes, [widths[2 * i] for i in axes], ends, assume_inbound=symbolic)
        if axes
        else output_grad
    )
    return [grad] + [no_grad(a) for a in orig_call.args[1:]]


@gradient("relax.stack")
def stack_grad(orig_var: Var, orig_call: Call, output_grad: Var, ctx: BlockBuilder) -> list[Expr]:
    """``stack``: the output's gradient split along the new axis, each part squeezed back to its
    input's shape (TVM has none; the frontend stacks an LSTM's steps, timm's Sequencer)."""
    fields = orig_call.args[0].ty.fields
    axis = int(orig_call.attrs.axis) % len(orig_var.ty.shape) if orig_call.attrs.axis is not None else 0
    parts = output_grad if len(fields) == 1 else emit(ctx, op.split(output_grad, len(fields), axis))
    grads = [
        emit(ctx, op.squeeze(parts if len(fields) == 1 else emit(ctx, relax.TupleGetItem(parts, i)), [axis]))
        for i in range(len(fields))
    ]
    return [relax.Tuple(grads)]
