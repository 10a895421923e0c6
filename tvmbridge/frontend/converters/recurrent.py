"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` in ATen's arithmetic: every layer and direction unrolled
over the traced sequence, with the final states (the frontend's converters take one layer and give
the output only, so ``_, (h, c) = lstm(x)`` and stacked recurrent layers were refused)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tvm import relax

from ...errors import UnsupportedOpError
from .random import layer_dropout
from .registry import args_of, converter, op_name

if TYPE_CHECKING:
    from ..importer import BridgeImporter

_ARGS = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first")
State = tuple[relax.Expr, ...]
# (block builder, the step's input gates, its hidden gates, the state, hidden size) -> new state
Step = Callable[[relax.BlockBuilder, relax.Expr, relax.Expr, State, int], State]


def _chunks(bb: relax.BlockBuilder, gates: relax.Expr, hidden: int, count: int) -> list[relax.Expr]:
    return [
        bb.emit(relax.op.strided_slice(gates, axes=[1], begin=[k * hidden], end=[(k + 1) * hidden]))
        for k in range(count)
    ]


def _lstm_step(bb: relax.BlockBuilder, x_gates: relax.Expr, h_gates: relax.Expr, state: State, hidden: int) -> State:
    """ATen's LSTMCell: gates i, f, g, o; ``c = f * c + i * g``, ``h = o * tanh(c)``."""
    op = relax.op
    i, f, g, o = _chunks(bb, bb.emit(op.add(x_gates, h_gates)), hidden, 4)
    c = bb.emit(op.add(op.multiply(op.sigmoid(f), state[1]), op.multiply(op.sigmoid(i), op.tanh(g))))
    return bb.emit(op.multiply(op.sigmoid(o), op.tanh(c))), c


def _gru_step(bb: relax.BlockBuilder, x_gates: relax.Expr, h_gates: relax.Expr, state: State, hidden: int) -> State:
    """ATen's GRUCell: ``r, z = sigmoid(h_rz + x_rz)``, ``n = tanh(x_n + h_n * r)``,
    ``h = (h - n) * z + n`` (the reset gate scales the hidden projection with its bias)."""
    op = relax.op
    x_r, x_z, x_n = _chunks(bb, x_gates, hidden, 3)
    h_r, h_z, h_n = _chunks(bb, h_gates, hidden, 3)
    reset, update = bb.emit(op.sigmoid(op.add(h_r, x_r))), bb.emit(op.sigmoid(op.add(h_z, x_z)))
    new = bb.emit(op.tanh(op.add(x_n, op.multiply(h_n, reset))))
    return (bb.emit(op.add(op.multiply(op.subtract(state[0], new), update), new)),)


def _simple_step(nonlinearity: Callable[[relax.Expr], relax.Expr]) -> Step:
    def step(bb: relax.BlockBuilder, x_gates: relax.Expr, h_gates: relax.Expr, state: State, hidden: int) -> State:
        return (bb.emit(nonlinearity(relax.op.add(h_gates, x_gates))),)

    return step


@dataclass(frozen=True)
class Cell:
    """A recurrent cell: its gate count, step and number of state tensors (LSTM: h and c)."""

    gates: int
    step: Step
    states: int = 1


CELLS = {
    "lstm": Cell(4, _lstm_step, states=2),
    "gru": Cell(3, _gru_step),
    "rnn_tanh": Cell(1, _simple_step(relax.op.tanh)),
    "rnn_relu": Cell(1, _simple_step(relax.op.nn.relu)),
}


def _direction(
    bb: relax.BlockBuilder, cell: Cell, seq: relax.Expr, weights: list, state: State, hidden: int, reverse: bool
) -> tuple[relax.Expr, State]:
    """One direction of one layer over ``seq`` (time, batch, features): its outputs (time,
    batch, hidden) and last state. As ATen's CPU layers: the input projection of every step in
    one product ``x W_ih^T + b_ih``, the hidden one ``h W_hh^T + b_hh`` per step."""
    op = relax.op
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if len(weights) == 4 else (None, None)
    projected = bb.emit(op.matmul(seq, op.permute_dims(w_ih, [1, 0])))
    if b_ih is not None:
        projected = bb.emit(op.add(projected, b_ih))
    w_hh_t = bb.emit(op.permute_dims(w_hh, [1, 0]))
    outputs: list[relax.Expr] = []
    for t in reversed(range(int(seq.ty.shape[0]))) if reverse else range(int(seq.ty.shape[0])):
        recurrent = op.matmul(state[0], w_hh_t)
        recurrent = bb.emit(recurrent if b_hh is None else op.add(recurrent, b_hh))
        x_gates = bb.emit(op.take(projected, relax.const(t, "int64"), axis=0))
        state = cell.step(bb, x_gates, recurrent, state, hidden)
        outputs.append(state[0])
    if reverse:
        outputs.reverse()
    return bb.emit(op.stack(outputs, axis=0)), state


@converter("lstm.input", "gru.input", "rnn_tanh.input", "rnn_relu.input")
def recurrent(importer: BridgeImporter, node: torch.fx.Node) -> relax.Expr:
    """``(output, h_n[, c_n])`` for any number of layers, either direction, with or without
    biases and initial states, dropout between layers in training (:func:`layer_dropout`: the
    masks ATen's CPU kernel draws, drawn per call; refused on GPUs, where cuDNN draws them). Refused:
    LSTM projections (``proj_size``)."""
    kind = op_name(node).split(".")[0]
    cell, given = CELLS[kind], dict(zip(_ARGS, args_of(node)))
    bb, op = importer.block_builder, relax.op
    layers, directions = int(given["num_layers"]), 2 if given["bidirectional"] else 1
    per = 4 if given["has_biases"] else 2
    params = [importer.env[p] for p in given["params"]]
    if len(params) != layers * directions * per:
        raise UnsupportedOpError("convert", "nn.LSTM with proj_size (projected hidden states)", op=kind)
    seq = importer.env[given["input"]]
    if given["batch_first"]:
        seq = bb.emit(op.permute_dims(seq, [1, 0, 2]))
    hidden = int(params[0].ty.shape[0]) // cell.gates
    hx = given["hx"]
    initial = [importer.env[s] for s in (hx if isinstance(hx, (list, tuple)) else [hx] if hx is not None else [])]
    zeros = relax.ShapeExpr([seq.ty.shape[1], hidden])
    finals: list[list[relax.Expr]] = [[] for _ in range(cell.states)]
    for layer in range(layers):
        outputs = []
        for d in range(directions):
            k = layer * directions + d
            state = (
                tuple(bb.emit(op.take(s, relax.const(k, "int64"), axis=0)) for s in initial)
                if initial
                else tuple(bb.emit(op.zeros(zeros, str(seq.ty.dtype))) for _ in range(cell.states))
            )
            out, state = _direction(bb, cell, seq, params[k * per : (k + 1) * per], state, hidden, reverse=d == 1)
            outputs.append(out)
            for final, s in zip(finals, state):
                final.append(s)
        seq = outputs[0] if directions == 1 else bb.emit(op.concat(outputs, axis=2))
        if given["train"] and float(given["dropout"]) > 0 and layer < layers - 1:
            out = node.meta["val"][0]
            if out.device.type != "cpu":  # cuDNN draws its dropout from a state of its own
                raise UnsupportedOpError(
                    "convert",
                    f"{kind} with dropout between its layers in train mode on {out.device.type}: cuDNN draws "
                    "those masks from its own dropout state, which the bridge cannot replay; set the RNN's "
                    "dropout to 0 (or put an nn.Dropout between single-layer RNNs), or use fallback=True",
                    op=kind,
                )
            shape = (out.shape[1], out.shape[0], out.shape[2]) if given["batch_first"] else tuple(out.shape)
            seq = layer_dropout(importer, seq, shape, out.dtype, float(given["dropout"]))
    if given["batch_first"]:
        seq = bb.emit(op.permute_dims(seq, [1, 0, 2]))
    return bb.emit(relax.Tuple([seq, *(bb.emit(op.stack(final, axis=0)) for final in finals)]))
