"""Which kernels a CPU schedule rule may take: wrappers around a rule that pass a kernel on to
the next rule (or leave it unscheduled, serial and correct) instead of letting the rule fail or
mis-schedule it.

The reduction rules are tried first on every kernel, and each builds a schedule and normalizes
the kernel before finding that it has no reduction; a model's kernels are mostly elementwise,
so :class:`ReductionKernels` looks at the kernel's blocks first (no schedule), which takes a
fraction of a millisecond where the two refusals took several.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule
from tvm.target import Target

from ..sizes import evaluate_dim
from .flatten_hazard import children
from .inline_budget import kept_as_blocks

_PACKAGE = Path(__file__).resolve().parents[1]
_BUGS = (AttributeError, NameError, TypeError)  # what a mistake in Python code raises, not a refusal


class ScheduleRuleWarning(UserWarning):
    """A CPU schedule rule of the bridge failed on a mistake in its own code (not a kernel it
    refuses): the kernel was compiled by the next rule or unscheduled (correct, slower). Please
    report it; the test suite turns it into an error."""


def _own_bug(exc: BaseException) -> bool:
    """Whether ``exc`` is a Python mistake raised by the bridge's own code (its last frame is in
    the package), as opposed to dlight's or TVM's refusal of a kernel."""
    if not isinstance(exc, _BUGS) or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return _PACKAGE in Path(tb.tb_frame.f_code.co_filename).resolve().parents


class Guarded(CPUScheduleRule):
    """A rule whose failure leaves the kernel to the next rule (or unscheduled, still correct)
    instead of aborting the build: dlight's analyses assert on shapes they do not expect, and
    TVM's schedule errors are RuntimeErrors. A failure that is a mistake in the bridge's own rule
    code is not taken as a refusal silently: it warns (:class:`ScheduleRuleWarning`), since it
    leaves kernels slow that the rule was written for."""

    def __init__(self, rule: CPUScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except Exception as exc:  # noqa: BLE001 - any failure of a rule: try the next one
            if _own_bug(exc):
                name = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "?"
                warnings.warn(
                    f"tvmbridge: the CPU schedule rule {_name(self.rule)} failed on kernel {name} with "
                    f"{type(exc).__name__}: {exc}; the kernel is compiled without it (correct, slower). "
                    "Please report this.",
                    ScheduleRuleWarning,
                    stacklevel=2,
                )
            return None


def _name(rule: CPUScheduleRule) -> str:
    inner = getattr(rule, "rule", None)
    return _name(inner) if isinstance(inner, CPUScheduleRule) else type(rule).__name__


def blocks(func: tirx.PrimFunc) -> list[s_tir.SBlock]:
    """Every block of ``func`` (the root block too), found by TVM's own traversal."""
    found: list[s_tir.SBlock] = []

    def keep(block: s_tir.SBlock) -> s_tir.SBlock:
        found.append(block)
        return block

    tvm_ffi.structural_map(func, [(s_tir.SBlock, keep)])
    return found


def reduces(block: s_tir.SBlock) -> bool:
    """Whether a block iterates over anything but data-parallel axes (dlight's "not injective")."""
    return any(int(iv.iter_type) != tirx.IterVar.DataPar for iv in block.iter_vars)


class ReductionKernels(CPUScheduleRule):
    """``rule`` only for kernels with a block that reduces (each reduction rule refuses the rest);
    with ``single_output``, only those whose blocks each write one buffer: dlight's
    ``cpu.Reduction`` mis-schedules tuple reductions (max-pool's gradient keeps an argmax and a
    max together) and gives wrong gradients."""

    def __init__(self, rule: CPUScheduleRule, single_output: bool = False) -> None:
        self.rule = rule
        self.single_output = single_output

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        found = blocks(func)
        if not any(reduces(b) for b in found):
            return None
        if self.single_output and any(len(b.writes) > 1 for b in found):
            return None
        return self.rule.apply(func, target, tunable)


class WithinInlineBudget(CPUScheduleRule):
    """``rule``, which inlines every block (dlight's reduction), only for kernels where that stays
    within :mod:`.inline_budget`'s budget: a chain that doubles per link is left to the next rule,
    or unscheduled (serial, compiled in seconds), instead of copied whole."""

    def __init__(self, rule: CPUScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos and kept_as_blocks(sch, [i.block_rv for i in infos], {sch.get(infos[-1].block_rv).name_hint}):
            return None
        return self.rule.apply(func, target, tunable)


# symbolic sizes are taken at this value to count a block's runs: large enough that work repeated
# along a symbolic axis stands out from any padding a split adds
_SYMBOLIC_SIZE = 256
# more runs of a block than this many times its iteration domain is repeated work, not padding (a
# loop split into vectors pads a row at most to one vector, 32 lanes of 16 bits)
_MAX_REPEAT = 32


def block_runs(func: tirx.PrimFunc) -> dict[str, int]:
    """Per block (by name, the root left out): how many times its body runs, the product of the
    extents of the loops around it, every symbolic size at ``_SYMBOLIC_SIZE``."""
    runs: dict[str, int] = {}
    stack: list[tuple[object, int]] = [(func.body, 1)]
    while stack:
        node, times = stack.pop()
        if isinstance(node, tirx.For):
            sizes = {v.name: _SYMBOLIC_SIZE for v in tirx.analysis.undefined_vars(node.extent)}
            stack.append((node.body, times * evaluate_dim(node.extent, sizes)))
            continue
        if isinstance(node, s_tir.SBlockRealize):
            if node.block.name_hint != "root":
                runs[node.block.name_hint] = runs.get(node.block.name_hint, 0) + times
            stack.append((node.block.body, times))
            continue
        stack.extend((child, times) for child in children(node) if isinstance(child, (tirx.Stmt, tvm_ffi.Array)))
    return runs


def repeated_work(before: tirx.PrimFunc, after: tirx.PrimFunc) -> str | None:
    """Which block ``after`` (a schedule of ``before``) runs many times more often than
    ``before`` does, if one does: a reduction computed at every row of a loop that its result does
    not vary along (dlight's CPU reduction rule does it to a softmax over a non-innermost axis: the
    whole reduction again for every output row)."""
    try:
        base, scheduled = block_runs(before), block_runs(after)
    except ValueError:  # a loop extent this cannot evaluate: no judgment
        return None
    for name, times in scheduled.items():
        if name in base and times > _MAX_REPEAT * base[name]:
            return f"block {name!r} runs {times // base[name]}x as often as its iteration domain"
    return None


class NoRepeatedWork(CPUScheduleRule):
    """``rule``'s schedule, unless it repeats a block's work (:func:`repeated_work`): then the
    next rule's."""

    def __init__(self, rule: CPUScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        space = self.rule.apply(func, target, tunable)
        sch = space[0] if isinstance(space, list) and space else space
        if sch is not None and repeated_work(func, sch.mod["main"]) is not None:
            return None
        return space
