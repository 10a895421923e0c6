"""The README's main job (``python -m tvmbridge demo``) and the command line around it."""
from __future__ import annotations

import pytest

from tvmbridge.tools import cli
from tvmbridge.tools.demo import run


def test_demo_trains_through_tvm_and_matches_pytorch(capsys):
    result = run(steps=2, timing_runs=2)
    worst = result["worst"]
    assert "output" in worst and "attention.self.query.weight" in worst and "input" in worst
    assert worst["output"] <= 1e-4, worst
    assert max(v for k, v in worst.items() if k != "output") <= 1e-5, worst
    assert result["step_ms"]["tvm"] > 0 and result["step_ms"]["pytorch"] > 0
    out = capsys.readouterr().out
    assert "captured values" in out and "time per training step" in out


def test_viz_unknown_stage_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["viz", "--small", "--stage", "no-such-stage", "--out", "unused"])
    message = str(exc.value)
    assert "no-such-stage" in message and "forward" in message and "backward" in message
