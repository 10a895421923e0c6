"""A Python branch on a tensor's values, compiled for the way the sample call went.

``if labels.max() >= vocab_size: raise ValueError(...)`` (wav2vec2, HuBERT, SEW's CTC loss),
``if (mask == 1).all():``, ``if torch.isnan(x).any():``: ``torch.export`` cannot decide the
branch on fake tensors (``GuardOnDataDependentSymNode``). Retraced with the sample's real values
propagated (torch's draft-export mechanism, ``fake_tensor_propagate_real_tensors``), the branch
goes the way the sample went and torch writes that choice into the program as a run-time assertion
(``_assert_scalar``). The bridge compiles the assertion into its value flags: a later call whose
values go the other way runs PyTorch (which raises, or takes the other branch), as a failed index
check does. Never a silent wrong number: the program is used only where every value read feeds
such an assertion (no size or number computed from it) and no read depends on a random draw
(LayerDrop's ``torch.rand([]) < p`` would be decided once, for good).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch._functorch.config
from torch.export import ExportedProgram
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .trace_patches import ScopedPatch

_VALUE_READS = ("_local_scalar_dense", "item")
# what torch writes between a value read and its assertion
_SYMBOLIC_OPS = ("sym_ite", "sym_not", "eq", "ne", "ge", "gt", "le", "lt", "and_", "or_", "not_", "sym_and", "sym_or")


class UnsampledBranchError(Exception):
    """The trace failed on a branch on values (``first``: torch's error) that compiling as the
    sample took it would not guard (``reason``)."""

    def __init__(self, first: Exception, reason: str) -> None:
        super().__init__(reason)
        self.first, self.reason = first, reason


class _TraceNoise(logging.Filter):
    """Drops torch's "Unable to find user code ..." warning (with the partial graph) about a value
    read while the bridge traces: the branch it is about is the bridge's to report, by its line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unable to find user code")


@contextlib.contextmanager
def quiet_value_reads() -> Iterator[None]:
    """The block's traces log nothing about value reads (:class:`_TraceNoise`)."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    quiet = _TraceNoise()
    shapes_log.addFilter(quiet)
    try:
        yield
    finally:
        shapes_log.removeFilter(quiet)


def _decided(shape_env: ShapeEnv, orig_expr: Any, result: Any) -> None:
    """``ShapeEnv._log_real_tensor_propagation``: in a thread that samples branches, each decision
    is kept (for :func:`unguarded_decision`), not logged; elsewhere, torch's."""
    if _PATCH.here:
        _PATCH.local.decisions.append(orig_expr)
    else:
        _PATCH.original(shape_env, orig_expr, result)


_PATCH = ScopedPatch(ShapeEnv, "_log_real_tensor_propagation", _decided)


@contextlib.contextmanager
def branches_as_sampled(devices: list[torch.device]) -> Iterator[list]:
    """The block traces with the sample's real values propagated: a branch on values goes the way
    the sample went, written as a run-time assertion; yields the decisions made so (their
    expressions). The real ops it runs draw nothing from the user's generators (forked) and
    write no user tensor (export functionalizes)."""
    cuda = [d.index or 0 for d in devices if d.type == "cuda"]
    decisions: list = []
    _PATCH.local.decisions = decisions
    with (
        _PATCH.scope(),
        torch.random.fork_rng(devices=cuda),
        torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True),
    ):
        yield decisions


def unguarded_decision(decisions: list) -> str | None:
    """A decision torch cannot guard at run time, or None: one on a float read (``x.max().item() >
    2.5``) leaves no assertion in the program (its symbols are ``zuf*``); only integer and
    boolean reads (``u*``), with input sizes (``s*``), do."""
    for expr in decisions:
        if any(not str(s).startswith(("u", "s")) for s in getattr(expr, "free_symbols", ())):
            return f"a branch on a float value read from a tensor ({expr})"
    return None


def _ancestors(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    seen, todo = {node}, [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
                yield parent


def feeds_only_assertions(read: torch.fx.Node) -> bool:
    """Every use of the value read is symbolic logic that ends in ``_assert_scalar``."""
    todo = list(read.users)
    while todo:
        user = todo.pop()
        name = getattr(user.target, "__name__", "")
        if user.op != "call_function":
            return False
        if name.startswith("_assert_scalar"):
            continue
        if name not in _SYMBOLIC_OPS:
            return False
        todo += list(user.users)
    return True


def sampled_branches_refusal(ep: ExportedProgram) -> str | None:
    """Why the program traced with the sample's values must not be compiled, or None: a value read
    that does more than decide a branch (a size, a number in the computation), or one that
    depends on a random draw."""
    for node in ep.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "__name__", "").split(".")[0] not in _VALUE_READS:
            continue
        if not feeds_only_assertions(node):
            return f"a value read from a tensor used as a number or a size ({node.name})"
        if any(
            a.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(a.target, "tags", ())
            for a in _ancestors(node)
        ):
            return "a branch on a random draw (LayerDrop: decided once, it would hold for good)"
    return None
