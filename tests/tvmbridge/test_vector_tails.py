"""Rows whose length is no multiple of the vector width (a vocabulary of 30522 words, 1000
classes): every vector but a row's last runs vectorized, the last one under its predicate.

Before, the row rules refused such rows (a vocabulary's softmax sums ran serially: 133 ms of
BERT-MLM's step on a Zen 4, now 17) and the column rule strided down each column alone. The
kernels must still never read past a row (``test_cpu_schedules`` checks rows that start with
large values), and the partial vector must be peeled off by TVM's LoopPartition so that the rest
stays vectorized, which only the bridge's build context asks for (``codegen.LOOP_PARTITION``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax, s_tir, tirx
from tvm.target.codegen import llvm_get_vector_width

from tvmbridge.backend import build, codegen

from .test_cpu_schedules import TARGET, _kernels, _module, _run, _x

LANES = max(llvm_get_vector_width(TARGET) // 32, 2)


def _vector_loops(mod: tvm.IRModule, config: dict) -> list[str]:
    """The scheduled kernels of ``mod`` lowered through TVM's TIR passes up to vectorization, in
    a pass context with ``config``: each kernel's TIR as code generation would receive it."""
    lowered = build.lower(mod, TARGET)
    kernels = {
        gv.name_hint: f.with_attr("global_symbol", gv.name_hint).with_attr("target", TARGET)
        for gv, f in lowered.functions.items()
        if isinstance(f, tirx.PrimFunc)
    }
    passes = [
        s_tir.transform.LowerInitBlock(),
        s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
        s_tir.transform.ConvertBlocksToOpaque(),
        s_tir.transform.CompactBufferAllocation(),
        s_tir.transform.LowerOpaqueBlock(),
        tirx.transform.FlattenBuffer(),
        tirx.transform.NarrowDataType(32),
        s_tir.transform.LoopPartition(),
        tirx.transform.VectorizeLoop(True),
    ]
    with tvm.transform.PassContext(config=config):
        out = tvm.transform.Sequential(passes)(tvm.IRModule(kernels))
    return [f.script() for f in out.functions.values()]


def _main_vectors(scripts: list[str]) -> bool:
    """Whether some kernel reads whole vectors of ``LANES`` (a ``Ramp`` of that many lanes)."""
    return any(f"1, {LANES})" in s and "T.Ramp(" in s for s in scripts)


def test_the_build_context_peels_the_partial_vector_off():
    """A ragged elementwise row: vectorized with the bridge's LoopPartition setting; without it
    TVM's vectorizer makes the whole row scalar (the condition varies by lane)."""
    n = 16 * LANES + 3
    mod = _module((6, n), lambda x: relax.op.add(relax.op.multiply(x, x), relax.const(1.0, "float32")))
    assert "T.likely" in _kernels(mod)
    assert _main_vectors(_vector_loops(mod, dict(codegen.LOOP_PARTITION)))
    assert not _main_vectors(_vector_loops(mod, {}))
    x = _x((6, n))
    np.testing.assert_allclose(_run(mod, x), x * x + 1, rtol=1e-6)


@pytest.mark.parametrize("n", [1003, 30522 // 8])
def test_a_ragged_row_sum_is_vectorized_and_exact(n):
    mod = _module((4, n), lambda x: relax.op.sum(relax.op.exp(x), axis=[1], keepdims=True))
    tir = _kernels(mod)
    assert "_rf" in tir and "T.likely" in tir
    assert _main_vectors(_vector_loops(mod, dict(codegen.LOOP_PARTITION)))
    x = _x((4, n))
    x[:, :LANES] = 20.0  # the next row's start, read past a row's end, would show
    np.testing.assert_allclose(_run(mod, x), np.exp(x.astype("float64")).sum(1, keepdims=True), rtol=2e-5)


@pytest.mark.parametrize("cols", [1003, 64 * 3 + 5])
def test_a_ragged_column_sum_runs_in_column_vectors(cols):
    """A vocabulary-sized bias gradient (``collapse_sum`` over the rows): threads own blocks of
    columns, the last block partial."""
    mod = _module((300, cols), lambda x: relax.op.sum(x, axis=[0]))
    tir = _kernels(mod)
    assert "_rf" not in tir and "T.likely" in tir
    # the column blocks but the last free of the bounds check (LLVM vectorizes their loop)
    assert all(f"< {cols}" not in f for f in _vector_loops(mod, dict(codegen.LOOP_PARTITION)))
    assert any(f"< {cols}" in f for f in _vector_loops(mod, {}))
    x = _x((300, cols))
    np.testing.assert_allclose(_run(mod, x), x.astype("float64").sum(0), rtol=1e-4, atol=1e-4)


def test_a_language_model_loss_writes_no_one_hot():
    """Cross-entropy's gradient at the target class is a one-hot per row: a ``where`` that fuses
    into log-softmax's backward (it was a zeros fill, a scatter and a row sum of the scattered
    tensor, each over the whole (rows, vocabulary)), and the sum of the one-hot over the classes
    is the row's own value. The loss and every gradient equal PyTorch's in float64."""
    from tests.helpers import clone_module, relative_errors, run_step
    from tvmbridge import add_tvm_dispatch

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 203)

        def forward(self, h, labels):
            return torch.nn.functional.cross_entropy(self.proj(h), labels, ignore_index=-100)

    torch.manual_seed(0)
    m = Head().double()
    ref = clone_module(m)
    h, labels = torch.randn(12, 16, dtype=torch.float64), torch.randint(0, 203, (12,))
    labels[3] = -100
    add_tvm_dispatch(m, (h, labels))
    backward = m._tvm_dispatch.compiled.stages["split"]["backward"].script()
    assert "scatter_elements" not in backward and "R.zeros" not in backward
    assert "R.logical_and" in backward  # the one-hot's sum: the row's value where its label is a class
    errs = relative_errors(run_step(m, (h.requires_grad_(), labels)), run_step(ref, (h, labels)))
    assert max(errs.values()) <= 1e-10, errs


_N = tirx.Var("n", "int64")


@pytest.mark.parametrize("shape,body,ref", [
    ((2, _N, 152), lambda x: relax.op.sum(x, axis=[0, 1]), lambda a: a.sum((0, 1))),
    ((_N, 1003), lambda x: relax.op.nn.log_softmax(x, axis=1),
     lambda a: torch.from_numpy(a).log_softmax(1).numpy()),
    ((_N, 1003), lambda x: relax.op.multiply(x, x), lambda a: a * a),
], ids=["columns-over-symbolic-rows", "log-softmax-of-symbolic-rows", "elementwise-symbolic-rows"])
def test_ragged_rows_beside_symbolic_sizes(shape, body, ref):
    """A variant that serves every sequence length: ragged rows and columns beside a symbolic
    size build and compute right. (A partial column block over a symbolic reduction failed to
    build, TVM's LoopPartition mixing int32 and int64 indices: coat_tiny's symbolic variant; such
    a kernel keeps its columns whole where they divide, strided otherwise.)"""
    mod = _module(shape, body)
    for n in (5, 7):
        x = _x(tuple(n if not isinstance(d, int) else d for d in shape)) * 3
        np.testing.assert_allclose(_run(mod, x), ref(x), rtol=1e-4, atol=1e-4)
