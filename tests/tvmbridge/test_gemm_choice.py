"""GEMM libraries chosen by measurement, cached on disk per machine (backend/gemm_choice.py)."""
from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

from tests.helpers import bert_inputs, bert_layer, clone_module, max_errors, run_step
from tvmbridge import add_tvm_dispatch
from tvmbridge.backend import gemm_choice
from tvmbridge.backend.gemm_choice import ChoiceCache, GemmChooser, GemmProblem, time_gemms
from tvmbridge.kernels.gemm import onednn_available

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch build without a working oneDNN")
PROBLEM = GemmProblem("float32", (64, 96), (48, 96), False, True)  # x @ W.T, a linear layer


class CountingTimer:
    """A fake timer: ``faster`` wins; counts how often it was asked."""

    def __init__(self, faster: str = "onednn") -> None:
        self.faster = faster
        self.calls = 0

    def __call__(self, problem: GemmProblem, libraries: list[str]) -> dict[str, float]:
        self.calls += 1
        return {lib: 1e-3 if lib == self.faster else 2e-3 for lib in libraries}


@needs_onednn
def test_real_timing_measures_every_candidate():
    seconds = time_gemms(PROBLEM, PROBLEM.candidates())
    assert set(seconds) == {"torch", "onednn"} and all(0 < t < 1 for t in seconds.values())


class SleepingLibraries:
    """Fake libraries whose every call takes ``seconds``; counts the calls of each."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls: dict[str, int] = {}

    def __call__(self, lib: str):
        def call(a, b, bias):
            self.calls[lib] = self.calls.get(lib, 0) + 1
            time.sleep(self.seconds)

        return call


@pytest.mark.parametrize("call_s, expected_calls", [(0.001, 4), (0.08, 2)])
def test_timing_rounds_follow_the_budget(call_s, expected_calls, monkeypatch):
    """Short calls: a warm-up round and at least three timed ones; calls whose warm-up round takes
    the budget (a vocabulary GEMM): that round and one timed round."""
    libs = SleepingLibraries(call_s)
    monkeypatch.setattr(gemm_choice, "library_call", libs)
    seconds = time_gemms(PROBLEM, ["torch", "onednn"], budget_s=0.1)
    assert set(seconds) == {"torch", "onednn"} and all(t >= call_s for t in seconds.values())
    counts = set(libs.calls.values())
    assert (min(counts) >= 4) if expected_calls == 4 else counts == {2}


@needs_onednn
@pytest.mark.parametrize("faster", ["onednn", "torch"])
def test_the_faster_library_is_chosen_and_cached(faster, tmp_path):
    timer = CountingTimer(faster)
    first = GemmChooser("auto", ChoiceCache(tmp_path / "c.json"), timer).choose(PROBLEM)
    assert (first.library, first.reason, timer.calls) == (faster, "measured", 1)
    again = GemmChooser("auto", ChoiceCache(tmp_path / "c.json"), timer).choose(PROBLEM)  # a new process
    assert (again.library, again.reason, timer.calls) == (faster, "cached", 1)


@needs_onednn
def test_cache_is_keyed_by_thread_count(tmp_path):
    timer = CountingTimer()
    threads = torch.get_num_threads()
    GemmChooser("auto", ChoiceCache(tmp_path / "c.json"), timer).choose(PROBLEM)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = GemmChooser("auto", ChoiceCache(tmp_path / "c.json"), timer).choose(PROBLEM)
    finally:
        torch.set_num_threads(threads)
    assert other.reason == "measured" and timer.calls == 2
    data = json.loads((tmp_path / "c.json").read_text())
    assert len(data["machines"]) == 2  # both machine keys kept in one file
    assert GemmChooser("auto", ChoiceCache(tmp_path / "c.json"), timer).choose(PROBLEM).reason == "cached"


@needs_onednn
@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 99, "machines": {}}), "[]"])
def test_unreadable_or_foreign_cache_warns_and_measures(content, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(content)
    timer = CountingTimer()
    with pytest.warns(UserWarning, match="GEMM choice cache"):
        cache = ChoiceCache(path)
    decision = GemmChooser("auto", cache, timer).choose(PROBLEM)
    assert decision.reason == "measured" and timer.calls == 1
    assert json.loads(path.read_text())["format"] == 1  # rewritten in the current format


@needs_onednn
def test_unwritable_cache_warns_and_still_chooses(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not write"):
        decision = GemmChooser("auto", ChoiceCache(blocker / "sub" / "c.json"), CountingTimer()).choose(PROBLEM)
    assert decision.library == "onednn"


def test_a_cached_library_that_no_longer_fits_is_measured_again(tmp_path):
    """A cache entry naming a library that cannot run the GEMM now (e.g. oneDNN disabled since)
    is not trusted."""
    path = tmp_path / "c.json"
    cache = ChoiceCache(path)
    problem = GemmProblem("float64", (4, 8), (8, 3), False, False)  # oneDNN never runs float64
    cache._choices[problem.key] = {"library": "onednn", "seconds": {}}
    assert cache.get(problem) is None


def test_fixed_backend_measures_nothing(tmp_path):
    timer = CountingTimer()
    d = GemmChooser("torch", ChoiceCache(tmp_path / "c.json"), timer).choose(PROBLEM)
    assert (d.library, timer.calls) == ("torch", 0) and "offload_matmul" in d.reason


def test_compile_records_choices_and_numbers_are_unchanged():
    """Whatever was chosen, the layer's outputs and gradients are PyTorch's; each choice is
    recorded and a second compile in the same machine state measures nothing."""
    layer, x = bert_layer(small=True), bert_inputs(hidden=64)
    ref = clone_module(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        add_tvm_dispatch(layer, x)
    choices = layer._tvm_dispatch.variants[0].compiled.gemm_choices
    assert choices and all(c.library in c.problem.candidates() for c in choices)
    assert all(c.reason in ("measured", "cached", "only candidate") for c in choices)
    assert max(max_errors(run_step(layer, x), run_step(ref, x)).values()) < 1e-4
    assert "GEMMs:" in layer._tvm_dispatch.explain()
    from tvmbridge.caches import CACHES

    CACHES.clear()  # compile again, not reuse the first compile
    again = clone_module(ref)
    add_tvm_dispatch(again, x)
    assert all(c.reason in ("cached", "only candidate") for c in again._tvm_dispatch.variants[0].compiled.gemm_choices)


@pytest.mark.parametrize("library", ["torch", "onednn"])
def test_bfloat16_gemms_of_each_library_round_once(library):
    """Autocast's bfloat16 GEMMs on each library: the float32 product of the bfloat16 operands
    (bias included) rounded once to bfloat16, within one bfloat16 rounding, and bfloat16 out;
    oneDNN is a candidate only where its start-up probe passed for bfloat16."""
    from tvmbridge.kernels.gemm import library_call, onednn_works

    problem = GemmProblem("bfloat16", (64, 96), (48, 96), False, True)
    if library == "onednn":
        if not (onednn_available() and onednn_works("bfloat16")):
            assert "onednn" not in problem.candidates()
            pytest.skip("oneDNN has no working bfloat16 inner product here")
        assert "onednn" in problem.candidates()
    g = torch.Generator().manual_seed(0)
    a, w, bias = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((64, 96), (48, 96), (48,)))
    with torch.autocast("cpu", dtype=torch.float16):  # ignored inside: the graph fixed the dtype
        y = library_call(library)(a, w.mT, bias)
    exact = torch.addmm(bias.double(), a.double(), w.double().mT)
    assert y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-2).all()
