"""Every test compiles from scratch: the process-wide cache of compiles (``pipeline.SHARED_CACHE``)
would otherwise let a test reuse another test's compile and skip the code it means to exercise."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    import sys

    pipeline = sys.modules.get("tvmbridge.pipeline")  # not imported by analysis-only tests
    if pipeline is not None:
        pipeline.SHARED_CACHE.clear()
    yield
