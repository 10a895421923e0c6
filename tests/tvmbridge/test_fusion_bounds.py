"""The pass that keeps FuseOps linear: the fusion must be exactly FuseOps' own, with or without it.

Graphs are built with long-range consumers (a value read by the next op and by one hundreds of ops
later), the shape that made FuseOps quadratic, mixed with block outputs, reductions and layout ops;
the fused and FuseTIR'd module with the pass must equal, structurally, the one without it.
"""

from __future__ import annotations

import random

import pytest
import tvm
import tvm_ffi
from tvm import relax

from tvmbridge.backend.fusion_bounds import ALIAS_SUFFIX, bound_fusion_search, unfusable_far


def _graph(
    n: int, seed: int, far_every: int, reach: int, outputs_rate: float = 0.0, mixed: bool = True
) -> tvm.IRModule:
    """``n`` ops over (4, 8) tensors: mostly elementwise on the previous value, every
    ``far_every``-th also reading a value ``reach`` ops back; a few reductions and transposes in
    between (unless not ``mixed``: then all is elementwise and fuses up to FuseOps' limit), and
    block outputs at ``outputs_rate`` (a block output ends every post-dominator chain through it)."""
    rng = random.Random(seed)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            values: list[relax.Expr] = [x]
            outputs = []
            for i in range(n):
                prev = values[-1]
                kind = rng.random()
                if i % far_every == 0 and len(values) > reach:
                    new = relax.op.add(prev, values[-reach])
                elif kind < 0.05 * mixed:
                    new = relax.op.add(prev, relax.op.sum(prev, axis=[1], keepdims=True))
                elif kind < 0.1 * mixed:
                    new = relax.op.permute_dims(relax.op.permute_dims(prev, [1, 0]), [1, 0])
                elif kind < 0.6:
                    new = relax.op.exp(relax.op.negative(prev))
                else:
                    new = relax.op.multiply(prev, prev)
                value = bb.emit(new)
                if rng.random() < outputs_rate:
                    value = bb.emit_output(value)
                    outputs.append(value)
                values.append(value)
            last = bb.emit_output(values[-1])
        bb.emit_func_output(relax.Tuple([last, *outputs]))
    with tvm.target.Target("llvm"):
        mod = relax.transform.LegalizeOps()(bb.get())
        return relax.transform.AnnotateTIROpPattern()(mod)


def _fused(mod: tvm.IRModule, bounded: bool) -> tvm.IRModule:
    seq = [bound_fusion_search] if bounded else []
    seq += [relax.transform.FuseOps(), relax.transform.FuseTIR(), relax.transform.DeadCodeElimination()]
    with tvm.target.Target("llvm"):
        return tvm.transform.Sequential(seq)(mod)


@pytest.mark.parametrize(
    "seed,far_every,reach,outputs_rate,mixed",
    [
        (0, 7, 300, 0.0, True),
        (1, 3, 40, 0.0, True),
        (2, 11, 600, 0.0, True),
        (3, 3, 40, 0.005, True),
        (4, 9, 120, 0.0, False),
        (5, 4, 200, 0.0, False),
    ],
)
def test_fusion_is_fuse_ops_own_with_far_consumers(
    seed: int, far_every: int, reach: int, outputs_rate: float, mixed: bool
) -> None:
    mod = _graph(900, seed, far_every, reach, outputs_rate, mixed)
    assert unfusable_far(mod["main"].body.blocks[0])  # the case has what the pass is for
    bounded, plain = _fused(mod, True), _fused(mod, False)
    assert tvm_ffi.structural_equal(bounded, plain)
    names = [b.var.name for b in bounded["main"].body.blocks[0].bindings]
    assert not any(name.endswith(ALIAS_SUFFIX) for name in names)  # the aliases are gone


def test_far_values_are_found_and_near_ones_left() -> None:
    """A value read again 300 ops later (past the depth limit) is marked; one read 20 ops later
    by a chain that ends there is not."""
    far = unfusable_far(_graph(900, 0, 7, 300)["main"].body.blocks[0])
    near = unfusable_far(_graph(900, 0, 50, 20)["main"].body.blocks[0])
    assert len(far) > 50
    assert near == []


def test_the_depth_limit_is_read_from_the_pass_context() -> None:
    """Under a larger ``relax.FuseOps.max_depth`` a value 300 ops from its post-dominator may
    fuse: it is not marked, and the fusion is still FuseOps' own."""
    mod = _graph(900, 0, 7, 300)
    with tvm.transform.PassContext(config={"relax.FuseOps.max_depth": 2000}):
        marked = bound_fusion_search(mod)
        assert tvm_ffi.structural_equal(marked, mod)
        assert tvm_ffi.structural_equal(_fused(mod, True), _fused(mod, False))
