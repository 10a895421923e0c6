"""Every notebook under notebooks/ executes top to bottom in a real Jupyter kernel (nbclient), and
its outputs show what the notebook is about; the notebooks are stored without outputs.

The kernel is this interpreter (the venv's python): a kernel spec manager with no kernel
directories offers only ipykernel's own ``python3`` spec, which runs ``sys.executable``, so a
``python3`` kernel spec installed for another Python elsewhere on the machine is never used.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300

# per notebook: text every one of which some output must contain, and the MIME types of the
# pictures it displays (the SVG only where graphviz's `dot` is installed)
EXPECTED: dict[str, tuple[list[str], list[str]]] = {
    "01_bert_inference.ipynb": (
        ["BaseModelOutputWithPoolingAndCrossAttentions", "last_hidden_state", "max abs error vs PyTorch",
         "def forward_infer(", "GEMM calls", "CPU: ", "TVM / eager: "], []),
    "02_training.ipynb": (
        ["'split', 'offload', 'low_precision', 'convolutions', 'fast_math', 'build'", "grad_fn: TVMFunctionBackward", "capture policy min-cut",
         "verdict: numerical noise", "verdict: DEVIATION", "first deviating op:", "aten.gelu",
         "TVM: loss grad_fn TVMFunctionBackward", "max |loss difference| over 20 steps", "20 compiled, 0 PyTorch"],
        ["image/png"] + (["image/svg+xml"] if shutil.which("dot") else [])),
    "03_profiler.ipynb": (
        ["FakeTensor (2, 32, 64)", "total: forward", "layer_0_attention_self_query",
         "BertEncoder.layer.0.attention", "forward FLOPs:  profile", "saved for backward: profile"], ["image/png"]),
    "04_memory.ipynb": (
        ["program order: peak", "optimal_order (", "proved optimal:"], ["image/png"]),
}

pytest.importorskip("nbclient", reason="the test extra installs nbclient, nbformat and ipykernel")
pytest.importorskip("ipykernel", reason="the test extra installs nbclient, nbformat and ipykernel")


def _execute(nb):
    """Run ``nb`` in a fresh kernel of this interpreter, working directory notebooks/."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    client = NotebookClient(nb, km=km, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute(cleanup_kc=True)  # raises CellExecutionError (with the traceback) on a failing cell
    return nb


def _outputs(nb) -> tuple[str, set[str]]:
    """All text the executed code cells showed, and the MIME types of their rich outputs."""
    text, mimes = [], set()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                text.append(out["text"])
            elif out["output_type"] in ("execute_result", "display_data"):
                mimes.update(out["data"])
                text.append(out["data"].get("text/plain", ""))
    return "\n".join(text), mimes


def test_every_notebook_has_expectations():
    assert NOTEBOOKS, f"no notebooks under {NOTEBOOK_DIR}"
    assert {p.name for p in NOTEBOOKS} == set(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name}: cell {i} has outputs"


def test_kernel_runs_this_interpreter():
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.prefix)")])
    text, _ = _outputs(_execute(nb))
    assert text.strip() == sys.prefix  # the venv, not the Python it was made from


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path):
    import nbformat

    nb = _execute(nbformat.read(path, as_version=4))
    text, mimes = _outputs(nb)
    markers, pictures = EXPECTED[path.name]
    missing = [m for m in markers if m not in text]
    assert not missing, f"{path.name}: outputs lack {missing}; outputs were:\n{text[-4000:]}"
    assert set(pictures) <= mimes, f"{path.name}: displayed {sorted(mimes)}, expected {pictures}"
