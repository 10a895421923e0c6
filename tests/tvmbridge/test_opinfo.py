"""PyTorch's OpInfo samples through the bridge (``tests/opinfo_sweep.py`` says how each case is
judged: exact, a clear refusal, or a commented skip; wrong numbers and crashes fail).

The default run takes one sample (float64 with gradients, float32 forward) of the ops issue 14
added gradients or converters for; ``-m slow`` runs the full sweep over every op the converter
claims (``scripts/opinfo_sweep.py`` prints its summary and refusals)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (pip install -e .[test])")

from .. import opinfo_sweep as sw  # noqa: E402

# one op per gradient or converter of issue 14 (and the where-broadcast gradient: diag_embed)
FAST_OPS = [
    "clamp", "nn.functional.hardtanh", "nn.functional.leaky_relu",
    "nn.functional.group_norm", "nn.functional.conv1d", "nn.functional.conv_transpose2d",
    "nn.functional.adaptive_avg_pool2d", "nn.functional.interpolate.bilinear", "nn.functional.interpolate.nearest",
    "_upsample_bilinear2d_aa", "nn.functional.pad.constant", "flip", "repeat", "logsumexp",
    "linalg.vector_norm", "diag_embed", "var_mean", "std_mean",
]


@pytest.fixture(scope="module")
def infos() -> dict:
    return {sw.full_name(i): i for i in sw.op_db()}


@pytest.mark.parametrize("name", FAST_OPS)
def test_first_sample_is_exact(name, infos):
    info = infos[name]
    assert sw.claimed(info), f"the converter no longer claims {name}"
    sample = sw.samples(info, 1)[0]
    for dtype in (torch.float64, torch.float32):
        outcome = sw.run_case(info, sample, 0, dtype)
        assert outcome.kind == "exact", outcome


def test_a_refusal_is_classified_with_its_reason(infos):
    """An output sized by the values of a tensor is refused at convert, saying so."""
    info = infos["masked_select"]
    outcome = sw.run_case(info, sw.samples(info, 1)[0], 0, torch.float64)
    assert outcome.kind == "refused" and "depends on the values" in outcome.reason


def test_summary_counts_each_kind():
    cases = [sw.Outcome("a", 0, "float64", "exact"), sw.Outcome("a", 0, "float32", "refused", "why"),
             sw.Outcome("b", 0, "float64", "skip", "no tensor output")]
    assert sw.summary(cases).startswith("1/2 exact, 1 refused, 0 wrong, 0 crash (1 skipped, 2 ops)")
    assert sw.refusals_by_reason(cases) == {"why": ["a"]}


@pytest.mark.slow
def test_full_sweep_has_no_wrong_number_and_no_crash():
    """Every op the converter claims, 2 samples each (about 15 min on 2 cores)."""
    outcomes = list(sw.sweep(sw.op_db(), 2))
    bad = [o for o in outcomes if o.kind in ("wrong", "crash")]
    print(sw.summary(outcomes))
    assert not bad, bad[:20]


@pytest.mark.parametrize("name", ["index_add", "index_copy", "index_select", "gather", "take_along_dim"])
def test_error_inputs_raise_as_pytorch_raises(name, infos):
    """PyTorch's own error inputs of the ops that read or write at indices: the dispatched call
    raises wherever PyTorch does (index_add broadcast a source of the wrong shape before)."""
    assert not list(sw.error_sweep([infos[name]]))


# a call that writes its result into ``out=`` tensors of another dtype: the compiled code returns
# new tensors (a forward that passes ``out=`` is not what the bridge compiles for)
KNOWN_SILENT = ("aminmax: returned",)


@pytest.mark.slow
def test_error_inputs_of_every_claimed_op_raise():
    """Every claimed op's error inputs (about 70 s on 2 cores)."""
    silent = [s for s in sw.error_sweep(sw.op_db()) if not s.startswith(KNOWN_SILENT)]
    assert not silent, silent
