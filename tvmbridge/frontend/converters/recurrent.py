"""``nn.LSTM`` in ATen's arithmetic: every layer and direction unrolled over the traced sequence,
with the final hidden and cell states (the frontend's converter takes one layer and gives the
output only, so ``_, (h, c) = lstm(x)`` and stacked LSTMs were refused)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tvm import relax

from ...errors import UnsupportedOpError
from .registry import args_of, converter

if TYPE_CHECKING:
    from ..importer import BridgeImporter

_LSTM_ARGS = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first")


def _direction(
    bb: relax.BlockBuilder, seq: relax.Expr, weights: list, h: relax.Expr, c: relax.Expr, hidden: int, reverse: bool
) -> tuple[relax.Expr, relax.Expr, relax.Expr]:
    """One direction of one layer over ``seq`` (time, batch, features): its outputs (time,
    batch, hidden), last h and last c. As ATen's CPU LSTM: the input projection of every step in
    one product, ``gates = (x W_ih^T + b_ih) + (h W_hh^T + b_hh)`` split i, f, g, o,
    ``c = f * c + i * g``, ``h = o * tanh(c)``."""
    op = relax.op
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if len(weights) == 4 else (None, None)
    projected = bb.emit(op.matmul(seq, op.permute_dims(w_ih, [1, 0])))
    if b_ih is not None:
        projected = bb.emit(op.add(projected, b_ih))
    w_hh_t = bb.emit(op.permute_dims(w_hh, [1, 0]))
    steps = int(seq.ty.shape[0])
    outputs: list[relax.Expr] = []
    for t in reversed(range(steps)) if reverse else range(steps):
        recurrent = op.matmul(h, w_hh_t)
        recurrent = bb.emit(recurrent if b_hh is None else op.add(recurrent, b_hh))
        gates = bb.emit(op.add(bb.emit(op.take(projected, relax.const(t, "int64"), axis=0)), recurrent))
        i, f, g, o = (
            bb.emit(op.strided_slice(gates, axes=[1], begin=[k * hidden], end=[(k + 1) * hidden])) for k in range(4)
        )
        c = bb.emit(op.add(op.multiply(op.sigmoid(f), c), op.multiply(op.sigmoid(i), op.tanh(g))))
        h = bb.emit(op.multiply(op.sigmoid(o), op.tanh(c)))
        outputs.append(h)
    if reverse:
        outputs.reverse()
    return bb.emit(op.stack(outputs, axis=0)), h, c


@converter("lstm.input")
def lstm(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``(output, h_n, c_n)`` of ``nn.LSTM`` for any number of layers, either direction, with or
    without biases and initial states. Refused: projections (``proj_size``); dropout between
    layers in training is refused before conversion (its masks are drawn inside ATen's kernel)."""
    given = dict(zip(_LSTM_ARGS, args_of(node)))
    bb, op = importer.block_builder, relax.op
    layers, directions = int(given["num_layers"]), 2 if given["bidirectional"] else 1
    per = 4 if given["has_biases"] else 2
    params = [importer.env[p] for p in given["params"]]
    if len(params) != layers * directions * per:
        raise UnsupportedOpError("convert", "nn.LSTM with proj_size (projected hidden states)", op="lstm")
    seq = importer.env[given["input"]]
    if given["batch_first"]:
        seq = bb.emit(op.permute_dims(seq, [1, 0, 2]))
    hidden = int(params[0].ty.shape[0]) // 4
    batch, dtype = seq.ty.shape[1], str(seq.ty.dtype)
    initial = [importer.env[s] for s in given["hx"]] if given["hx"] else []
    last_h, last_c = [], []
    for layer in range(layers):
        outputs = []
        for d in range(directions):
            k = layer * directions + d
            if initial:
                h0, c0 = (bb.emit(op.take(s, relax.const(k, "int64"), axis=0)) for s in initial)
            else:
                h0 = c0 = bb.emit(op.zeros(relax.ShapeExpr([batch, hidden]), dtype))
            out, h, c = _direction(bb, seq, params[k * per : (k + 1) * per], h0, c0, hidden, reverse=d == 1)
            outputs.append(out)
            last_h.append(h)
            last_c.append(c)
        seq = outputs[0] if directions == 1 else bb.emit(op.concat(outputs, axis=2))
    if given["batch_first"]:
        seq = bb.emit(op.permute_dims(seq, [1, 0, 2]))
    h_n, c_n = bb.emit(op.stack(last_h, axis=0)), bb.emit(op.stack(last_c, axis=0))
    return bb.emit(relax.Tuple([seq, h_n, c_n]))
