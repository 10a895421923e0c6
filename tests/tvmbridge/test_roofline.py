"""The roofline the benchmarks print (``tools/roofline.py``): a step's FLOPs are the analysis
counter's forward and backward, the peak is a measured GEMM rate, and a rate cell is their ratio."""
from __future__ import annotations

import re

import torch

from tvmbridge.tools import roofline
from tvmbridge.tools.timing import cpu_name


def test_step_flops_count_forward_and_backward():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    flops = roofline.step_flops(lambda: lin(x).sum().backward())
    # the forward GEMM, the input's and the weight's gradients, and the sum's 16 * 32 additions
    assert flops == 3 * 2 * 16 * 64 * 32 + 16 * 32


def test_peak_is_a_measured_gemm_rate_and_a_cell_its_fraction():
    peak = roofline.measure_peak(torch.float32, size=256, seconds=0.05)
    assert peak.dtype == "float32" and peak.gflops > 0.1 and "256^3" in peak.probe
    seconds = 2 * 256**3 / (peak.gflops * 1e9) * 2  # a step at half the peak rate
    assert abs(peak.fraction(2 * 256**3, seconds) - 0.5) < 1e-9
    header = roofline.roofline_header((torch.float32,))
    assert re.search(r"float32 \d+ GFLOP/s", header) and roofline.isa() in header


def test_the_machine_is_named_with_family_and_model():
    name = cpu_name()
    assert name and name != "unknown CPU"
    text = open("/proc/cpuinfo").read()
    if "cpu family" in text:
        assert re.search(r"\(family \d+, model \d+\)$", name)


def test_the_peak_is_the_fastest_library_a_step_may_call(monkeypatch):
    """A step's GEMMs may run on oneDNN where it beats ``torch.mm`` (MKL): a peak timed on
    ``torch.mm`` alone would put such a step above 100% of it."""
    import time

    from tvmbridge.kernels.gemm import onednn_available

    a = torch.randn(64, 64)
    assert ("oneDNN" in roofline._gemm_probes(a, a)) == onednn_available()
    slow = {"slow": lambda: time.sleep(2e-3), "fast": lambda: None}
    monkeypatch.setattr(roofline, "_gemm_probes", lambda a, b: slow)
    peak = roofline.measure_peak.__wrapped__(torch.float32, size=32, seconds=0.01)
    assert peak.library == "fast" and peak.gflops > 2 * 32**3 / 2e-3 / 1e9
