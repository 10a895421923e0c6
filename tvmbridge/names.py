"""Names the stages agree on: Relax function names, parameter prefixes, packed-function prefix.

One place for each, so that the stage that writes a name and the stage that reads it cannot drift.
"""

from __future__ import annotations

MAIN = "main"  # the frontend's function
ADJOINT = f"{MAIN}_adjoint"  # the differentiated MAIN (the name Relax's Gradient would give it)
FORWARD = "forward"  # primal params -> (outputs..., captures...)
FORWARD_INFER = "forward_infer"  # primal params -> outputs (no_grad calls: nothing captured)
BACKWARD = "backward"  # (captures..., primal params read..., grad_outs...) -> grads

RANDOM_INPUT = "random"  # prefix of the per-call random inputs (dropout masks, noise, ...)
GRAD_OUT = "grad_out"  # prefix of the output-gradient parameters of the adjoint
VJP_PROD = "vjp_prod"  # prefix of the bindings o_i * grad_out_i of the VJP target
SIZES = "call_sizes"  # the backward's last parameter when symbolic: the call's shape symbols (a shape)
SAVED = "saved_"  # prefix of the backward's parameters that receive captured values

PACKED_PREFIX = "tvmbridge."  # global functions the bridge registers with TVM's FFI
RANDOM_SITE = f"{PACKED_PREFIX}random_site"  # marker the importer emits, replaced by an input


def vjp_prod(index: int) -> str:
    return f"{VJP_PROD}{index}"


def vjp_prod_index(name: str) -> int | None:
    """``i`` for the name ``vjp_prod{i}``, else None."""
    rest = name.removeprefix(VJP_PROD)
    return int(rest) if rest != name and rest.isdigit() else None
