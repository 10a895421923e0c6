"""check_double: numerical noise vs a real deviation, and where the deviation starts."""
from __future__ import annotations

import pytest
import torch
from tvm import relax

from tests.helpers import bert_inputs, bert_layer
from tvmbridge import check_double


def _gelu_as_tanh(node, importer):
    """A deliberately wrong converter: exact GELU replaced by its tanh approximation."""
    return importer.block_builder.emit(relax.op.nn.gelu_tanh(importer.env[node.args[0]]))


def test_bert_layer_is_noise_in_double():
    report = check_double(bert_layer(small=True), bert_inputs(hidden=64))
    assert report.verdict == "noise", str(report)
    assert report.max_rel64 <= 1e-12
    assert max(e.rel32 for e in report.errors) > 1e-9  # float32 differs by rounding, float64 does not
    assert {e.name for e in report.errors} >= {"output0", "input0.grad", "intermediate.dense.weight.grad"}


def test_wrong_converter_is_a_deviation_and_named():
    report = check_double(bert_layer(small=True), bert_inputs(hidden=64), converters={"gelu.default": _gelu_as_tanh})
    assert report.verdict == "deviation"
    assert report.max_rel64 > 1e-6  # the approximation's error, the same in float64 as in float32
    assert "intermediate.dense.bias.grad" in report.worst
    assert report.first_deviation is not None and "aten.gelu" in report.first_deviation
    assert "modeling_bert.py:" in report.first_deviation  # the source line (the localizer's trace keeps stacks)
    assert "DEVIATION" in str(report)


def test_converters_option_is_checked():
    from tvmbridge import CompileOptions

    with pytest.raises(ValueError, match="converters"):
        CompileOptions(converters={"gelu.default": "not callable"})


def test_command_line_check_exits_zero_on_noise(capsys):
    from tvmbridge.tools.cli import main

    assert main(["check"]) == 0
    assert "numerical noise" in capsys.readouterr().out


def test_a_dispatched_module_is_checked_on_its_own_code():
    from tvmbridge import add_tvm_dispatch

    layer, x = bert_layer(small=True), bert_inputs(hidden=64)
    add_tvm_dispatch(layer, x)
    assert check_double(layer, x).verdict == "noise"
    assert layer._tvm_dispatch is not None  # the user's module keeps its dispatch


def test_a_model_computing_in_float32_inside_is_judged_at_float32_s_noise():
    """A float64 copy of a model that casts to float32 itself (transformers' RMSNorm) shows
    float32's noise: reported as such, not as a deviation; a wrong converter still is one."""
    from .test_safety_net import _exp_of_half, _Float32Inside

    model, x = _Float32Inside(), torch.randn(8, 512, dtype=torch.float64)
    report = check_double(model, x)
    assert report.computes_in == torch.float32 and report.verdict == "noise", str(report)
    assert "computes in float32 inside" in str(report) and report.max_rel64 > 1e-10  # not float64's noise
    assert check_double(model, x, converters={"exp.default": _exp_of_half}).verdict == "deviation"
    assert check_double(bert_layer(small=True), bert_inputs(hidden=64)).computes_in == torch.float64
