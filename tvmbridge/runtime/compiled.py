"""A compile made callable: the executable's VMs, pooled per compiled module.

``compile_training`` is the public entry for one signature (``add_tvm_dispatch`` compiles its
variants with it): the pipeline's :class:`~tvmbridge.pipeline.compile.CompileResult` (shared
with other modules of an equal graph) with VMs of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tvm import relax

from ..backend import build as backend_build
from ..options import CompileOptions, with_overrides
from ..pipeline.compile import CompileResult, compile_result


class CompiledModule(CompileResult):
    """A :class:`CompileResult` with a pool of VMs: a VM's registers belong to the call running
    on it, so concurrent calls each borrow their own (making one costs far more than a call, so
    short-lived threads reuse them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pool: list[relax.VirtualMachine] = []
        self._pool_lock = threading.Lock()
        self._instrument: Callable | None = None

    @classmethod
    def of(cls, result: CompileResult) -> CompiledModule:
        return cls(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)})

    @contextlib.contextmanager
    def vm(self) -> Iterator[relax.VirtualMachine]:
        """A VM of this module's executable, for one call."""
        with self._pool_lock:
            vm = self._pool.pop() if self._pool else None
        if vm is None:
            vm = backend_build.load(self.executable, self.device)
            if self._instrument is not None:
                vm.set_instrument(self._instrument)
        try:
            yield vm
        finally:
            with self._pool_lock:
                self._pool.append(vm)

    def set_instrument(self, instrument: Callable | None) -> None:
        """``VirtualMachine.set_instrument`` on every VM of this module, now and later (None: off)."""
        self._instrument = instrument
        with self._pool_lock:
            for vm in self._pool:
                vm.set_instrument(instrument if instrument is not None else (lambda *a: 0))


def compile_training(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    options: CompileOptions | None = None,
    *,
    device: torch.device | None = None,
    dynamic: dict[int, frozenset[int]] | None = None,
    reuse: bool = False,
    **overrides: Any,
) -> CompiledModule:
    """Compile forward and backward of ``module`` for the signature of ``(args, kwargs)``.

    ``options`` (default :class:`CompileOptions()`) with keyword ``overrides`` of its fields
    (``capture="all"``, ``memory_budget=0.3``, ...). ``dynamic`` marks dims of the call's tensors
    (by position among them) to compile symbolically: one executable for every size there.
    With ``reuse``, a module whose traced graph equals one compiled before in this process reuses
    that compile (``tvmbridge.caches.CACHES.compiles``). Every failure is a ``ConversionError``
    naming the stage.
    """
    opts = with_overrides(options, overrides)
    args = args if isinstance(args, tuple) else (args,)
    result = compile_result(module, args, dict(kwargs or {}), opts, device=device, dynamic=dynamic, reuse=reuse)
    return CompiledModule.of(result)
