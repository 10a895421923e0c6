"""The converter registry (``frontend/converters``): one converter per aten op, every name a real
op, every family registered, the importer's table built from it (ops TVM lacks included), and the
user's converters still over the bridge's."""
from __future__ import annotations

import pkgutil

import pytest
import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from tvmbridge import UnsupportedOpError
from tvmbridge.frontend import converters
from tvmbridge.frontend.checks import known_ops, unsupported_ops
from tvmbridge.frontend.converters import CONVERTERS, Converter, converter
from tvmbridge.frontend.export import trace
from tvmbridge.frontend.importer import BridgeImporter, to_relax
from tvmbridge.sizes import evaluate_dim, evaluate_dims

from ..helpers import Fn


def _traced(fn, *args):
    return trace(Fn(fn), args)


def test_a_second_converter_for_an_op_is_refused_and_registers_nothing():
    def embedding_again(importer, node):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="second converter for embedding.default") as info:
        converter("not_an_op.default", "embedding.default")(embedding_again)
    assert "embedding_again" in str(info.value) and "indexing.embedding" in str(info.value)
    assert "not_an_op.default" not in CONVERTERS
    assert CONVERTERS["embedding.default"].fn.__name__ == "embedding"


def test_every_registered_name_is_an_op_overload():
    """aten's, or transformers' grouped product (registered when transformers' MoE code loads), or
    the Python-level functions export writes between a value read and its assertion."""
    pytest.importorskip("transformers.integrations.moe")
    for name in CONVERTERS:
        if name == "getitem":
            continue
        if name in ("sym_ite", "sym_not"):
            assert getattr(torch, name).__name__ == name
            continue
        packet, overload = name.rsplit(".", 1)
        namespace = torch.ops.transformers if packet == "grouped_mm_fallback" else torch.ops.aten
        op = getattr(getattr(namespace, packet), overload)
        assert isinstance(op, torch._ops.OpOverload) and op.__name__ == name


def test_every_family_module_is_imported_and_registers():
    modules = {m.name for m in pkgutil.iter_modules(converters.__path__)} - {"registry"}
    assert modules == {f.__name__.rsplit(".", 1)[1] for f in converters.FAMILIES}
    registering = {entry.fn.__module__ for entry in CONVERTERS.values()}
    assert registering == {f.__name__ for f in converters.FAMILIES}


def test_the_importer_table_holds_every_registered_converter():
    table = BridgeImporter().convert_map
    assert set(CONVERTERS) <= set(table)
    assert set(table) == known_ops()  # what unsupported_ops checks against
    assert "amax.default" in table and "amax.default" not in ExportedProgramImporter().convert_map


def test_a_converter_for_an_op_tvm_lacks_is_used(monkeypatch):
    """``i0`` has no converter in TVM's table: registering one makes the graph convert, and
    it is called with the importer and the node."""
    traced = _traced(lambda x: torch.special.i0(x) + 1, torch.rand(8))
    assert unsupported_ops(traced.exported) == ["i0.default"]
    calls = []

    def i0_zeros(importer, node):
        calls.append((type(importer), node.name))
        return importer.block_builder.emit(relax.op.zeros([8], "float32"))

    monkeypatch.setitem(CONVERTERS, "i0.default", Converter(i0_zeros))
    assert unsupported_ops(traced.exported) == []
    converted = to_relax(traced)
    assert calls == [(BridgeImporter, "i0")]
    assert "R.zeros" in converted.mod.script()


def test_a_wrapping_converter_gets_tvms_and_an_absent_one_is_named(monkeypatch):
    seen = []

    def relu_wrapped(importer, node, default):
        seen.append(default)
        return default(node)

    monkeypatch.setitem(CONVERTERS, "relu.default", Converter(relu_wrapped, wraps_default=True))
    to_relax(_traced(torch.relu, torch.randn(3)))
    assert len(seen) == 1 and callable(seen[0])
    monkeypatch.setitem(CONVERTERS, "i0.default", Converter(relu_wrapped, wraps_default=True))
    with pytest.raises(ValueError, match="relu_wrapped wraps TVM's converter of i0.default"):
        BridgeImporter()


def test_user_converters_replace_the_bridges():
    """``options.converters``: fn(node, importer), over the registered converter of the op."""
    calls = []

    def clamp_as_is(node, importer):
        calls.append(type(importer))
        return importer.env[node.args[0]]

    to_relax(_traced(lambda x: x.clamp(-1.0, 1.0), torch.randn(3)), (("clamp.default", clamp_as_is),))
    assert calls == [BridgeImporter]


def test_a_missing_converter_points_at_the_registry():
    with pytest.raises(UnsupportedOpError, match=r"add one in tvmbridge/frontend/converters/ \(a function under the @converter"):
        to_relax(_traced(torch.special.i0, torch.rand(8)))


def test_the_two_size_evaluators_agree():
    """A traced size's text (sympy) and its Relax form (TIR) give the same size at a call's sizes."""
    import tvm

    s0 = tvm.tirx.Var("s0", "int64")
    assert evaluate_dims((3, "2*s0 + 1"), {"s0": 5}) == (3, 11)
    assert evaluate_dim(s0 * 2 + 1, {"s0": 5}) == 11


class RoundedDivisions(torch.nn.Module):
    """Divisions with a rounding mode and a number beside a float tensor: a position table's
    ``arange(d) // 2`` (timm's XCiT and EdgeNeXt), ``//`` and ``trunc`` of activations."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        table = torch.arange(8, dtype=h.dtype) // 2 + torch.arange(8, dtype=h.dtype) // 2.5
        return h * table + torch.div(h * 3, 2, rounding_mode="trunc") + torch.div(7.0, h.abs() + 1, rounding_mode="floor")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rounded_division_by_a_number_trains_as_pytorch(dtype):
    """Converted in the tensor's dtype (the frontend's int64/float32 constant is refused beside
    it), with the zero gradient PyTorch gives a rounded quotient."""
    from tests.helpers import clone_module, max_errors, run_step
    from tvmbridge import add_tvm_dispatch

    torch.manual_seed(0)
    model, x = RoundedDivisions(dtype), torch.randn(4, 8, dtype=dtype)
    errs = max_errors(run_step(add_tvm_dispatch(clone_module(model), (x,)), (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < (1e-5 if dtype == torch.float32 else 1e-12), errs


def test_a_half_precision_rounded_division_reads_the_number_in_float32():
    """A bfloat16 ``x // 0.3`` as ATen computes it: both in float32 (0.3 not rounded to
    bfloat16 first), one rounding of the quotient."""
    from tvmbridge import add_tvm_dispatch

    fn = Fn(lambda x: torch.div(x, 0.3, rounding_mode="floor") + torch.div(x, 0.3, rounding_mode="trunc"))
    x = (torch.randn(64) * 20).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(add_tvm_dispatch(Fn(fn.fn), (x,))(x), fn(x))
