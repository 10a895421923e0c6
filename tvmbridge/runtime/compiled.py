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
from ..pipeline.parts import INFER, TRAIN


class CompiledModule(CompileResult):
    """A :class:`CompileResult` with a pool of VMs: a VM's registers belong to the call running
    on it, so concurrent calls each borrow their own (making one costs far more than a call, so
    short-lived threads reuse them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pools: dict[str, list[relax.VirtualMachine]] = {TRAIN: [], INFER: []}
        self._pool_lock = threading.Lock()
        self._instrument: Callable | None = None

    @classmethod
    def of(cls, result: CompileResult) -> CompiledModule:
        return cls(**{f.name: getattr(result, f.name) for f in dataclasses.fields(result)})

    @contextlib.contextmanager
    def vm(self, part: str = TRAIN) -> Iterator[relax.VirtualMachine]:
        """A VM of ``part``'s executable (built now if no call needed it before), for one call."""
        pool = self._pools[part]
        with self._pool_lock:
            vm = pool.pop() if pool else None
        if vm is None:
            vm = backend_build.load(self.parts.get(part), self.device)
            if self._instrument is not None:
                vm.set_instrument(self._instrument)
        try:
            yield vm
        finally:
            with self._pool_lock:
                pool.append(vm)

    def set_instrument(self, instrument: Callable | None) -> None:
        """``VirtualMachine.set_instrument`` on every VM of this module, now and later (None: off)."""
        self._instrument = instrument
        with self._pool_lock:
            for vm in (vm for pool in self._pools.values() for vm in pool):
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
    first_part: str = TRAIN,
    **overrides: Any,
) -> CompiledModule:
    """Compile forward and backward of ``module`` for the signature of ``(args, kwargs)``.

    ``options`` (default :class:`CompileOptions()`) with keyword ``overrides`` of its fields
    (``capture="all"``, ``memory_budget=0.3``, ...). ``dynamic`` marks dims of the call's tensors
    (by position among them) to compile symbolically: one executable for every size there.
    With ``reuse``, a module whose traced graph equals one compiled before in this process reuses
    that compile (``tvmbridge.caches.CACHES.compiles``). ``first_part``: the part built now
    (``"train"``: forward and backward; ``"infer"``: the no_grad forward); the other is built
    when a call first needs it. Every failure is a ``ConversionError`` naming the stage.
    """
    opts = with_overrides(options, overrides)
    args = args if isinstance(args, tuple) else (args,)
    result = compile_result(
        module, args, dict(kwargs or {}), opts, device=device, dynamic=dynamic, reuse=reuse, first_part=first_part
    )
    return CompiledModule.of(result)
