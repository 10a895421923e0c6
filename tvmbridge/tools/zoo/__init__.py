"""The model zoo: tiny random-weight models of many architectures, each trained a few steps through
the bridge and compared with PyTorch (float32) and a float64 reference, like PyTorch's own
HF/TIMM benchmark suites.

``models`` is the registry (how to build each model and the batch users would pass it),
``harness`` runs one case and gives its verdict (EXACT, FALLBACK, REFUSED, WRONG, CRASH);
``scripts/zoo.py`` runs them all, one subprocess per model, and prints the table.
"""

from __future__ import annotations
