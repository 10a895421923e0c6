"""The disk cache of compiled executables (``backend/executable_cache.py``): a new process with
the same model loads what an earlier one compiled, with PyTorch's numbers; anything that changes
the code is another key; a damaged entry is detected and compiled again; the directory stays
within its bound; writes are atomic under concurrent stores; it can be turned off."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import MLP, clone_module, max_errors, run_step
from tvmbridge import disk_cache
from tvmbridge.backend import build as backend_build
from tvmbridge.backend.executable_cache import ExecutableCache
from tvmbridge.caches import CACHES
from tvmbridge.pipeline.parts import INFER, TRAIN
from tvmbridge.devices import target_for
from tvmbridge.runtime.compiled import compile_training
from tvmbridge.runtime.dispatch import add_tvm_dispatch, dispatcher_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TVMBRIDGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TVMBRIDGE_DISK_CACHE", "1")
    return tmp_path / "executables"


def _fresh_executable(model: torch.nn.Module, x: torch.Tensor, **options):
    """An executable as the build makes it, before any store (a compile without the disk cache
    hands out a library already loaded, which TVM cannot export again)."""
    compiled = compile_training(model, (x,), disk_cache=False, **options)
    return backend_build.compile_module(compiled.stages["fast_math"], target_for(compiled.device))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP(d=16, h=32)


def _compile(model, x, **options):
    CACHES.clear()  # the process cache would answer first
    return compile_training(model, (x,), **options)


def _dispatched(model, x, **options):
    """A copy of ``model`` dispatched to TVM, and its compile."""
    CACHES.clear()
    module = add_tvm_dispatch(clone_module(model), (x,), **options)
    return module, dispatcher_of(module).variants[0].compiled


def _libraries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.so"))


def test_second_compile_loads_and_matches_pytorch(cache_dir):
    model, x = _model(), torch.randn(4, 16)
    first, compiled = _dispatched(model, x)
    assert not compiled.executable_loaded and len(_libraries(cache_dir)) == 1
    second, compiled = _dispatched(model, x)
    assert compiled.executable_loaded, "an equal module compiled again instead of loading"
    assert "loaded from the disk cache" in compiled.summary()
    for module in (first, second):
        errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
        assert max(errs.values()) < 1e-5, errs


def test_without_a_stored_result_the_executable_is_found_after_lowering(cache_dir, monkeypatch):
    """The compile result's entry gone (evicted), its executable not: the key computed beside the
    lowering finds the executable, no code is generated, and the numbers are PyTorch's."""
    import shutil

    model, x = _model(), torch.randn(4, 16)
    _dispatched(model, x)
    shutil.rmtree(cache_dir.parent / "compiles")
    monkeypatch.setattr(backend_build, "_codegen", lambda *a: pytest.fail("generated code for a stored executable"))
    module, compiled = _dispatched(model, x)
    assert compiled.executable_loaded and not compiled.result_loaded
    errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < 1e-5, errs


def test_options_that_change_the_code_are_another_key(cache_dir):
    model, x = _model(), torch.randn(4, 16)
    _compile(model, x)
    other = _compile(model, x, fuse=False)
    assert not other.executable_loaded
    assert len(_libraries(cache_dir)) == 2
    bigger = _compile(model, torch.randn(5, 16), dynamic=False)
    assert not bigger.executable_loaded  # another shape: another module


@pytest.mark.parametrize("damage", ["truncate", "flip", "record"])
def test_a_damaged_entry_is_compiled_again(cache_dir, damage):
    model, x = _model(), torch.randn(4, 16)
    _compile(model, x)
    (lib,) = _libraries(cache_dir)
    (record,) = cache_dir.glob("*.json")
    data = lib.read_bytes()
    # damaged as a disk or another process damages it: a new file in its place (this process has
    # the library mapped, and a mapped file written in place is the loader's undefined behaviour)
    damaged = lib.with_name("damaged")
    if damage == "truncate":
        damaged.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        damaged.write_bytes(data[:-100] + bytes(b ^ 0xFF for b in data[-100:]))
    else:
        lib = record
        damaged.write_text("{not json")
    os.replace(damaged, lib)
    with pytest.warns(UserWarning, match="damaged"):
        again, compiled = _dispatched(model, x)
    assert not compiled.executable_loaded
    errs = max_errors(run_step(again, (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < 1e-5, errs
    assert _compile(model, x).executable_loaded  # the entry was written anew, whole


def test_turned_off_by_option_and_environment(cache_dir, monkeypatch):
    model, x = _model(), torch.randn(4, 16)
    assert not _compile(model, x, disk_cache=False).executable_loaded
    assert not cache_dir.exists() or not _libraries(cache_dir)
    monkeypatch.setenv("TVMBRIDGE_DISK_CACHE", "0")
    _compile(model, x)
    assert not cache_dir.exists() or not _libraries(cache_dir)


def test_the_directory_stays_within_its_bound(cache_dir):
    model = _model()
    _compile(model, torch.randn(2, 16), dynamic=False)
    (first,) = _libraries(cache_dir)
    (record,) = cache_dir.glob("*.json")
    one = first.stat().st_size + record.stat().st_size
    cache = ExecutableCache(cache_dir, limit=int(one * 2.5))
    os.utime(record, (1, 1))  # the oldest use
    exe = _fresh_executable(model, torch.randn(3, 16), dynamic=False)
    for key in ("a" * 64, "b" * 64):
        assert cache.store(key, exe)
    assert first not in _libraries(cache_dir), "the least recently used entry was kept over the bound"
    assert sum(size for _, size, _ in cache.entries()) <= cache.limit
    assert {p.stem for p in cache_dir.glob("*.json")} == {"a" * 64, "b" * 64}


def test_concurrent_stores_leave_one_whole_entry(cache_dir):
    model, x = _model(), torch.randn(4, 16)
    exe = _fresh_executable(model, x)
    cache = ExecutableCache(cache_dir)
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(cache.store("c" * 64, exe))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 4
    assert [p.name for p in cache_dir.glob(".tmp-*")] == []
    assert [p.stem for p in cache_dir.glob("*.json")] == ["c" * 64] and len(_libraries(cache_dir)) == 1
    assert cache.load("c" * 64) is not None


def test_a_writer_replacing_an_entry_never_shows_a_half_one(cache_dir):
    """Another process storing the same key with a different library (a nondeterministic build)
    between this one's store and load: the record names the library it describes, so the reader
    gets one whole entry, never one library checked against the other's record."""
    model, x = _model(), torch.randn(4, 16)
    exe = _fresh_executable(model, x)
    cache = ExecutableCache(cache_dir)
    assert cache.store("d" * 64, exe)
    (mine,) = _libraries(cache_dir)
    theirs = cache_dir / ("d" * 64 + "-0123456789abcdef.so")
    theirs.write_bytes(mine.read_bytes() + b"\0" * 64)  # another library, its own record
    record = json.loads((cache_dir / ("d" * 64 + ".json")).read_text())
    other = {
        **record,
        "file": theirs.name,
        "size": theirs.stat().st_size,
        "sha256": hashlib.sha256(theirs.read_bytes()).hexdigest(),
    }
    (cache_dir / ("d" * 64 + ".json")).write_text(json.dumps(other))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "damaged" entry
        assert cache.load("d" * 64) is not None
    os.utime(mine, (1, 1))  # the replaced library, long unused: the next write's eviction removes it
    cache.evict()
    assert not mine.exists() and theirs.exists()


def test_an_unwritable_directory_is_a_warning_not_an_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TVMBRIDGE_CACHE_DIR", str(blocker))
    monkeypatch.setenv("TVMBRIDGE_DISK_CACHE", "1")
    disk_cache.warn_once.cache_clear()
    model, x = _model(), torch.randn(4, 16)
    with pytest.warns(UserWarning, match="could not store the compiled executable"):
        module, _ = _dispatched(model, x)
    errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < 1e-5, errs


SCRIPT = textwrap.dedent("""
    import torch
    from tests.helpers import MLP, run_step
    from tvmbridge import add_tvm_dispatch
    from tvmbridge.runtime.dispatch import dispatcher_of
    torch.manual_seed(0)
    model = MLP(d=16, h=32)
    x = torch.randn(4, 16)
    add_tvm_dispatch(model, (x,))
    outs, grads = run_step(model, (x,))
    variants = dispatcher_of(model).variants
    print("LOADED", all(v.compiled.executable_loaded for v in variants))
    print("RESULT", all(v.compiled.result_loaded for v in variants))
    print("SUM", float(outs[0].sum()), float(sum(g.sum() for g in grads.values())))
""")


def test_a_new_process_loads_what_another_compiled(cache_dir):
    env = {**os.environ, "TVMBRIDGE_CACHE_DIR": str(cache_dir.parent), "TVMBRIDGE_DISK_CACHE": "1"}
    runs = [
        subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    lines = [
        dict(line.split(" ", 1) for line in r.stdout.splitlines() if line[:4] in ("LOAD", "RESU", "SUM ")) for r in runs
    ]
    assert lines[0]["LOADED"] == "False" and lines[1]["LOADED"] == "True", lines
    assert lines[0]["RESULT"] == "False" and lines[1]["RESULT"] == "True", lines  # gradient, split not redone
    assert lines[0]["SUM"] == lines[1]["SUM"]  # the same numbers from the loaded executable


def test_the_dropout_mask_kernel_is_built_once_per_machine(cache_dir, monkeypatch):
    """The bridge's own mask kernel (``kernels.mt19937``), which every process needs before its
    first step, is loaded from the cache by the next one; the loaded kernel draws PyTorch's masks;
    a damaged library is built again."""
    import tvm

    from tvmbridge.kernels import mt19937

    kernels = cache_dir.parent / "kernels"
    mt19937._kernel.cache_clear()
    mt19937.kernel_works.cache_clear()
    try:
        assert mt19937.kernel_works()
        assert len(list(kernels.glob("*.so"))) == 1
        mt19937._kernel.cache_clear()
        mt19937.kernel_works.cache_clear()

        def no_compile(*args, **kwargs):
            raise AssertionError("the kernel was compiled again")

        with monkeypatch.context() as m:
            m.setattr(tvm, "compile", no_compile)
            assert mt19937.kernel_works()  # loaded, and it still reproduces bernoulli_
        (library,) = kernels.glob("*.so")
        head = library.read_bytes()[:1000]
        library.unlink()  # a new file: this process still maps the old one
        library.write_bytes(head)
        mt19937._kernel.cache_clear()
        mt19937.kernel_works.cache_clear()
        with pytest.warns(UserWarning, match="kernel library .* is damaged"):
            assert mt19937.kernel_works()
        assert len(list(kernels.glob("*.so"))) == 1
    finally:
        mt19937._kernel.cache_clear()
        mt19937.kernel_works.cache_clear()


def test_a_part_built_after_the_compile_loads_in_a_later_process_without_lowering(cache_dir, monkeypatch):
    """The inference part, built by the first no_grad call, is stored; a later process's first
    no_grad call loads it by the key stored with the compile result, with no lowering (a part
    whose key was unknown had to be lowered to find it), and gives PyTorch's numbers."""
    model, x = _model(), torch.randn(4, 16)
    first, compiled = _dispatched(model, x)
    assert compiled.first_part == TRAIN and not compiled.parts.built(INFER) and INFER in compiled.parts.keys
    with torch.no_grad():
        first(x)
    assert compiled.parts.built(INFER) and not compiled.parts.loaded[INFER]
    module, again = _dispatched(model, x)
    assert again.result_loaded and not again.parts.built(INFER)
    monkeypatch.setattr(backend_build, "lower", lambda *a, **k: pytest.fail("lowered a stored part"))
    with torch.no_grad():
        torch.manual_seed(3)  # the same dropout masks
        got = module(x)
        torch.manual_seed(3)
        want = model(x)
    assert again.parts.loaded[INFER]
    torch.testing.assert_close(got, want)
