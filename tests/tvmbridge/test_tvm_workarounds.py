"""Minimal reproductions of the TVM 0.27 behaviours the bridge works around in its lowering
(``backend/build.py``): each test pins TVM's own behaviour, so that a TVM upgrade that fixes it
fails here and says which workaround can go, and checks the bridge's lowering of the same module."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tvmbridge.backend.build import compile_module, lower
from tvmbridge.devices import target_for

TARGET = target_for(torch.device("cpu"))


def _module(body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(x))
        bb.emit_func_output(out)
    return bb.get()


def _neg_inf_mask(x: relax.Expr) -> relax.Expr:
    return relax.op.add(x, relax.op.full((2, 3), relax.const(float("-inf"), "float32"), "float32"))


def test_tvm_cannot_legalize_a_non_finite_full():
    """TVM's ``topi.full`` tests ``"float" in dtype`` on a dtype object: ``-inf`` masks fail."""
    with pytest.raises(Exception, match="not iterable"):
        relax.transform.LegalizeOps()(_module(_neg_inf_mask))


def test_the_bridge_lowers_it_to_minus_infinity():
    vm = relax.VirtualMachine(compile_module(_module(_neg_inf_mask), TARGET), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(np.zeros((2, 3), "float32"))).numpy()
    assert np.isneginf(got).all()


def test_tvm_take_legalizes_to_fast_mode_and_the_bridge_clips():
    """Relax's ``take`` without a mode legalizes to TOPI's unchecked 'fast' mode (an out-of-range
    index reads out of bounds; TOPI logs a warning per kernel); the bridge's lowering clips, so the
    kernel never reads outside the table (the index range itself is checked by the bridge's flags)."""
    def body(x):
        return relax.op.take(x, relax.const(np.array([0, 2], "int64")), axis=1)

    ours = lower(_module(body), TARGET, schedule=False, fuse=False).script()
    assert "T.min(T.max(" in ours or "T.max(T.min(" in ours, ours
    theirs = relax.transform.LegalizeOps()(_module(body)).script()
    assert "T.min(T.max(" not in theirs and "T.max(T.min(" not in theirs


def test_relax_const_narrows_a_numpy_array_unless_given_a_dtype():
    """``relax.const`` makes a float64 array float32 and an int64 one int32 unless the dtype is
    passed: every constant the bridge builds from an array passes it."""
    assert str(relax.const(np.zeros(2, "float64")).ty.dtype) == "float32"
    assert str(relax.const(np.zeros(2, "int64")).ty.dtype) == "int32"
    assert str(relax.const(np.zeros(2, "float64"), "float64").ty.dtype) == "float64"

