"""Dedup (``passes/dedup.py``) on small modules: permute and reshape chains folded by binding
rules in one walk (they replaced TVM's pattern rewriter and ``RemoveRedundantReshape``, which did
the same folds by rewriting the whole function until nothing matched: seconds on a whole
model's adjoint). The cases pin the semantics those passes had, symbolic shapes included."""
from __future__ import annotations

import pytest
import tvm
from tvm import relax, tirx

from tvmbridge.ir import per_function
from tvmbridge.passes import Dedup, DedupAndSimplify, Simplify

R = relax.op
N = tirx.Var("n", "int64")


def _module(shape: tuple, body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _count(mod: tvm.IRModule, op: str) -> int:
    return sum(isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == op
               for blk in mod["main"].body.blocks for b in blk.bindings)


@pytest.mark.parametrize("name,shape,body,left", [
    ("chain", (2, 3, 4), lambda bb, x: R.reshape(bb.emit(R.reshape(x, (6, 4))), (24,)), 1),
    ("chain back to the input", (2, 3, 4), lambda bb, x: R.reshape(bb.emit(R.reshape(x, (6, 4))), (2, 3, 4)), 0),
    ("three in a row", (2, 3, 4), lambda bb, x: R.reshape(bb.emit(R.reshape(bb.emit(R.reshape(x, (6, 4))), (4, 6))), (24,)), 1),
    ("to its own shape", (2, 3, 4), lambda bb, x: R.reshape(x, (2, 3, 4)), 0),
    ("symbolic, to its own shape", (N, 4), lambda bb, x: R.reshape(x, (N, 4)), 0),
    ("symbolic chain", (N, 4), lambda bb, x: R.reshape(bb.emit(R.reshape(x, (N * 4,))), (N, 2, 2)), 1),
    ("symbolic chain back to the input", (N, 4), lambda bb, x: R.reshape(bb.emit(R.reshape(x, (N * 4,))), (N, 4)), 0),
])
def test_reshape_chains_fold(name, shape, body, left):
    mod = _module(shape, body)
    out = Dedup()(mod)
    assert _count(out, "relax.reshape") == left, out.script()
    tvm.ir.assert_structural_equal(out["main"].ret_ty, mod["main"].ret_ty)


def test_permute_chains_fold():
    mod = _module((2, 3, 4), lambda bb, x: R.permute_dims(bb.emit(R.permute_dims(x, [2, 0, 1])), [1, 2, 0]))
    assert _count(Dedup()(mod), "relax.permute_dims") == 0


def test_a_permute_chain_over_symbolic_sizes_folds():
    """Composing permutations needs the rank only: a chain over a symbolic batch folds as well."""
    mod = _module((N, 3, 4), lambda bb, x: R.permute_dims(bb.emit(R.permute_dims(x, [2, 0, 1])), [1, 2, 0]))
    assert _count(Dedup()(mod), "relax.permute_dims") == 0


def test_a_chain_of_four_permutes_is_one():
    """Four permutes (the last an identity) compose to the one they amount to."""
    def body(bb, x):
        a = bb.emit(R.permute_dims(x, [1, 0, 2]))
        b = bb.emit(R.permute_dims(a, [0, 2, 1]))
        c = bb.emit(R.permute_dims(b, [2, 1, 0]))
        return R.permute_dims(c, [0, 1, 2])

    out = Dedup()(_module((2, 3, 4), body))
    (permute,) = [b.value for b in out["main"].body.blocks[0].bindings if getattr(b.value, "op", None) is not None
                  and b.value.op.name == "relax.permute_dims"]
    assert [int(a) for a in permute.attrs.axes] == [0, 2, 1]
    assert permute.args[0].same_as(out["main"].params[0])


def test_dedup_and_simplify_under_one_cleanup_is_dedup_then_simplify():
    """The split stage runs both passes' rules under one clean-up (``DedupAndSimplify``): the
    same module as ``Dedup`` then ``Simplify``, on permute and reshape chains, neutral elements,
    ``*_like`` ops and duplicates."""
    def body(bb, x):
        p = bb.emit(R.permute_dims(bb.emit(R.permute_dims(x, [2, 0, 1])), [1, 2, 0]))
        r = bb.emit(R.reshape(bb.emit(R.reshape(p, (6, 4))), (2, 3, 4)))
        one = bb.emit(R.multiply(r, bb.emit(R.ones_like(r))))
        a, b = bb.emit(R.exp(one)), bb.emit(R.exp(one))
        zero = bb.emit(R.zeros_like(x))
        return R.add(bb.emit(R.add(a, b)), zero)

    mod = _module((2, 3, 4), body)
    merged = DedupAndSimplify()(mod)
    tvm.ir.assert_structural_equal(merged, tvm.transform.Sequential([Dedup(), Simplify()])(mod))
    assert _count(merged, "relax.exp") == 1 and _count(merged, "relax.permute_dims") == 0
    assert _count(merged, "relax.reshape") == 0 and _count(merged, "relax.zeros_like") == 0
    assert _count(merged, "relax.multiply") == 0


def _two_functions() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    for name in ("first", "second"):
        x = relax.Var("x", relax.TensorType((2, 3, 4), "float32"))
        with bb.function(name, [x]):
            with bb.dataflow():
                p = bb.emit(R.permute_dims(bb.emit(R.permute_dims(x, [2, 0, 1])), [1, 2, 0]))
                a, b = bb.emit(R.exp(p)), bb.emit(R.exp(p))
                out = bb.emit_output(R.add(a, b))
            bb.emit_func_output(out)
    return bb.get()


def test_a_pass_run_per_function_in_threads_is_the_pass_on_the_module():
    """``ir.per_function`` (the split stage's clean-up, each function in a thread): the module the
    pass makes of the whole, in the caller's pass context (a pass it disables stays off)."""
    mod = _two_functions()
    got = per_function(DedupAndSimplify(), mod)
    tvm.ir.assert_structural_equal(got, DedupAndSimplify()(mod))
    assert all(_count(tvm.IRModule({"main": got[n]}), "relax.exp") == 1 for n in ("first", "second"))
    assert all(_count(tvm.IRModule({"main": got[n]}), "relax.permute_dims") == 0 for n in ("first", "second"))
    with tvm.transform.PassContext(disabled_pass=["tvmbridge.FoldLayoutChains"]):
        kept = per_function(DedupAndSimplify(), mod)
    assert all(_count(tvm.IRModule({"main": kept[n]}), "relax.permute_dims") == 2 for n in ("first", "second"))
