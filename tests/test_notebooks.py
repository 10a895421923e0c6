"""The notebooks run top to bottom (code cells executed in order, as Jupyter would)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, capsys):
    cells = json.loads(path.read_text())["cells"]
    scope: dict = {"__name__": "__notebook__"}
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        code = "".join(cell["source"])
        exec(compile(code, f"{path.name}[{i}]", "exec"), scope)  # noqa: S102 - our own notebook
    assert "TVMFunctionBackward" in capsys.readouterr().out
