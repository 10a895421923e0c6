"""Schedules for GPU targets (CUDA, ROCm): dlight's rules, in TVM's order, each one guarded.

An unscheduled TIR kernel is not even valid on a GPU (no thread binding), so every kernel takes
the first dlight rule that applies to it. TVM's ``ApplyDefaultSchedule`` lets a rule's exception
end the build: ``gpu.Matmul`` asserts on a convolution whose consumers it cannot inline (every
ResNet's backward), ``gpu.GEMV`` on a scalar reduction; and ``gpu.GeneralReduction`` gives a
max-pool's backward (an argmax: a reduction to a pair) a cross-thread reduction that TIR's lowering
then cannot build. Guarded, a rule that raises, or whose schedule does not lower, counts as "does
not apply" and the next one (at the end ``gpu.Fallback``) schedules the kernel; each refusal is
kept on :attr:`Guarded.refusals` with its reason.

One fix after every rule: TVM's CUDA code generator writes a vectorized ``Select`` on a boolean
(``gpu.Matmul``'s epilogue vectorizes a ``where`` on a saved mask) as a ``float2`` initialized
from a ``ushort2``, which NVRTC rejects, so such loops are unrolled instead (:func:`unvectorize_selects`).
"""

from __future__ import annotations

import re
from typing import Any

import tvm
from tvm import s_tir
from tvm.s_tir import dlight


class Guarded(dlight.ScheduleRule):
    """``rule``, except that an exception it raises means "not applicable" (kept, with why)."""

    def __init__(self, rule: dlight.ScheduleRule) -> None:
        self.rule = rule
        self.refusals: list[tuple[str, str]] = []

    def apply(self, func: tvm.tirx.PrimFunc, target: tvm.target.Target, tunable: bool) -> Any:
        try:
            space = self.rule.apply(func, target, tunable)
            for sch in space if isinstance(space, list) else [] if space is None else [space]:
                unvectorize_selects(sch)
                _check_lowers(sch.mod, target)
            return space
        except Exception as exc:  # noqa: BLE001 - a rule's bug on one kernel: the next rule schedules it
            name = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else "?"
            self.refusals.append((name, f"{type(self.rule).__name__}: {type(exc).__name__}: {exc}"))
            return None


def unvectorize_selects(sch: s_tir.Schedule) -> None:
    """Unroll every vectorized loop around a block that selects (``where``) or reads a boolean:
    the CUDA code TVM writes for a vector of booleans does not compile. Unrolled, each lane is a
    scalar select; the vector loads and stores around it are the only loss."""
    func = sch.mod["main"]
    vectorized = []
    for block in sch.get_child_blocks(sch.get_sblock(func.body.block.name_hint)):
        loops = [loop for loop in sch.get_loops(block) if sch.get(loop).kind == tvm.tirx.ForKind.VECTORIZED]
        if loops:
            vectorized.append((block, loops))
    if not vectorized:
        return
    # TVM 0.27's Python has no TIR visitor: the boolean buffers (parameters and allocations) and
    # the selects are read off the printed kernel
    keys = ["T.Select(", "T.if_then_else("] + [f"{name}[" for name in _BOOL_BUFFER.findall(func.script())]
    for block, loops in vectorized:
        text = sch.get(block).script()
        if any(key in text for key in keys):
            for loop in loops:
                sch.unroll(loop)


_BOOL_BUFFER = re.compile(r'(\w+)(?:: T\.Buffer| = T\.sblock_alloc_buffer)\(\([^"]*\), "bool"')


def _check_lowers(mod: tvm.IRModule, target: tvm.target.Target) -> None:
    """Raise where TIR's lowering would refuse the schedule at code generation: a cross-thread
    reduction whose combiner it does not recognize (the one refusal seen from dlight's rules)."""
    with target:
        tvm.s_tir.transform.LowerCrossThreadReduction()(mod)


def gpu_schedule_rules() -> list[dlight.ScheduleRule]:
    """dlight's rules in TVM's order, without ``gpu.GEMV`` (it asserts on scalar reductions and
    the reductions' rules cover what it schedules), each guarded."""
    rules = [dlight.gpu.Matmul(), dlight.gpu.Reduction(), dlight.gpu.GeneralReduction(), dlight.gpu.Fallback()]
    return [Guarded(rule) for rule in rules]


def apply_gpu_schedules(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """Every unscheduled kernel of ``mod`` scheduled by the first rule that applies (in ``target``'s
    scope); ``mod`` itself is left as it was (dlight's pass mutates its input)."""
    with target:
        return dlight.ApplyDefaultSchedule(*gpu_schedule_rules())(mod.clone())
