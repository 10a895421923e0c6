"""Every test compiles from scratch and measures GEMMs into a cache of its own session. The
process-wide cache of compiles (``tvmbridge.caches.CACHES``)
would otherwise let a test reuse another test's compile and skip the code it means to exercise."""
from __future__ import annotations

import os
import tempfile

import pytest

# measured GEMM choices go to a fresh directory, never the user's cache (tests of the cache
# itself point it elsewhere again), and every executable is built: a test of the disk cache
# turns it on for itself. TVMBRIDGE_TEST_WARM_CACHE=<dir> runs the suite with the disk caches on
# in <dir> instead: run it twice, and the second run takes the warm path (traces, compile
# results and executables loaded) in every test.
if os.environ.get("TVMBRIDGE_TEST_WARM_CACHE"):
    os.environ["TVMBRIDGE_CACHE_DIR"] = os.environ["TVMBRIDGE_TEST_WARM_CACHE"]
    os.environ["TVMBRIDGE_DISK_CACHE"] = "1"
else:
    os.environ["TVMBRIDGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="tvmbridge-test-cache-")
    os.environ["TVMBRIDGE_DISK_CACHE"] = "0"


@pytest.fixture(autouse=True)
def _fresh_compile_cache():
    import sys

    caches = sys.modules.get("tvmbridge.caches")  # not imported by analysis-only tests
    if caches is not None:
        caches.CACHES.clear()
    yield
