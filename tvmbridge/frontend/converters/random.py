"""Random ops: a per-call input for every random value, never a value frozen at compile time.

Dropout in every form, ``bernoulli``, ``rand*``, ``randn*``, ... become :class:`RandomSite`
markers (``importer.random_input``) that ``passes.random`` turns into per-call inputs, drawn from
PyTorch's generator at every call (``runtime/random.py``). A random op whose draw depends on
computed values is refused. Dropout has registered converters; every other random op in a graph
is converted by :func:`convert_random` (``to_relax`` installs it for the ops it finds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tvm import relax

from ...errors import ConversionError, UnsupportedOpError
from ..sites import RandomSite, SizeList, TensorMeta
from .registry import args_of, converter, kwargs_of, op_name, uses_of_item

if TYPE_CHECKING:
    from ..importer import BridgeImporter

DROPOUT_OPS = {"dropout.default", "native_dropout.default"}
# random ops whose tensor arguments give only a shape, dtype and layout: replayable per call
_SHAPE_ONLY_RANDOM = {
    "bernoulli.p",
    "rand_like.default",
    "randn_like.default",
    "randint_like.default",
    "randint_like.low_dtype",
    "uniform.default",
    "exponential.default",
    "geometric.default",
    "log_normal.default",
    "cauchy.default",
    "random.default",
    "random.from",
    "random.to",
    "normal_functional.default",
}
# recurrent ops tagged random for their inter-layer dropout: random only when it is on
_RNN_OPS = {"lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input"}


def is_random(node: torch.fx.Node) -> bool:
    """The node draws random values outside a converter of its own (an RNN's inter-layer dropout
    is its converter's: :func:`layer_dropout`)."""
    if getattr(node.target, "__name__", "") in _RNN_OPS:
        return False
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def is_train_dropout(node: torch.fx.Node) -> bool:
    """A dropout that drops something: train mode and ``p > 0``."""
    args, kwargs = args_of(node), kwargs_of(node)
    if getattr(node.target, "__name__", "") not in DROPOUT_OPS:
        return False
    p = float(args[1])
    train = args[2] if len(args) > 2 else kwargs.get("train", True)
    return bool(train) and p > 0.0


def _dims(values: Any) -> tuple[int | str, ...]:
    """Sizes or strides as traced: ints, and the expression of a symbolic one as text (``s0``),
    which the runtime evaluates with the call's sizes."""
    return tuple(int(v) if isinstance(v, int) else str(v.node.expr) for v in values)


def _size_value(v: Any) -> int | str | None:
    """A size as traced (an int, or a symbolic one's expression), or None when ``v`` is none."""
    if isinstance(v, torch.fx.Node):
        v = v.meta.get("val")
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return int(v)
    return str(v.node.expr) if isinstance(v, torch.SymInt) else None


def _meta(value: Any) -> Any:
    """A random op's argument as the runtime replays it: a tensor's layout, a size list (fx's own
    list type, and symbolic sizes, would not reach the op), or the value itself."""
    if isinstance(value, (list, tuple)) and value:
        sizes = [s for s in map(_size_value, value) if s is not None]
        if len(sizes) == len(value):
            return SizeList(tuple(sizes))
    if isinstance(value, torch.fx.Node):
        v = value.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise ConversionError("convert", f"random op argument {value} is not a tensor")
        return TensorMeta(_dims(v.shape), _dims(v.stride()), v.dtype)
    if isinstance(value, torch.SymInt):
        raise UnsupportedOpError("convert", "a random op with a symbolic scalar argument", op="random")
    return list(value) if isinstance(value, list) else value


def convert_random(importer: BridgeImporter, node: torch.fx.Node) -> relax.Var:
    """Any other random op: replayed per call when its tensor arguments give only a layout."""
    args, kwargs = args_of(node), kwargs_of(node)
    name = op_name(node)
    tensor_args = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Node)]
    if tensor_args and name not in _SHAPE_ONLY_RANDOM:
        raise UnsupportedOpError(
            "convert",
            f"random op {name} draws from values the module computes; only random ops "
            "whose tensor arguments give a shape can become per-call inputs (use fallback=True)",
            op=name,
        )
    val = node.meta["val"]
    site = RandomSite(
        "op",
        _dims(val.shape),
        _dims(val.stride()),
        val.dtype,
        op=node.target,
        args=tuple(_meta(a) for a in args),
        kwargs={k: _meta(v) for k, v in kwargs.items()},
    )
    return importer.random_input(site, str(val.dtype).removeprefix("torch."), [importer.prim(d) for d in val.shape])


def _dropout_expr(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    args = args_of(node)
    x = importer.env[args[0]]
    if not is_train_dropout(node):
        return x
    if uses_of_item(node, 1) and op_name(node) == "native_dropout.default":
        raise UnsupportedOpError("convert", "the boolean mask output of native_dropout is used", op="native_dropout")
    val = args[0].meta["val"]
    offset = _dims((val.storage_offset(),))[0]
    site = RandomSite("dropout", _dims(val.shape), _dims(val.stride()), val.dtype, p=float(args[1]), offset=offset)
    # the mask's shape from the trace (a Relax type after a tuple getitem may not carry one)
    mask = importer.random_input(site, str(val.dtype).removeprefix("torch."), [importer.prim(d) for d in val.shape])
    return importer.block_builder.emit(relax.op.multiply(x, mask))


def layer_dropout(importer: BridgeImporter, x: relax.Expr, shape: tuple, dtype: torch.dtype, p: float) -> relax.Expr:
    """ATen's dropout between an RNN's layers in training (``apply_layer_stack``: each layer's
    output but the last, ``(seq, batch, directions * hidden)``, contiguous, through
    ``at::dropout(x, p, true)``), drawn per call as an ``aten.dropout`` of that layout, in layer
    order, where the fused op draws it."""
    stride = tuple(shape[1] * shape[2] if i == 0 else shape[2] if i == 1 else 1 for i in range(3))
    site = RandomSite("dropout", _dims(shape), _dims(stride), dtype, p=p, offset=0)
    mask = importer.random_input(site, str(dtype).removeprefix("torch."), [importer.prim(d) for d in shape])
    return importer.block_builder.emit(relax.op.multiply(x, mask))


@converter("dropout.default")
def dropout(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    return _dropout_expr(importer, node)


@converter("native_dropout.default")
def native_dropout(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    out = _dropout_expr(importer, node)
    return importer.block_builder.emit(relax.Tuple([out, out]))
