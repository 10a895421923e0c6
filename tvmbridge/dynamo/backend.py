"""``torch.compile(model, backend="tvmbridge")``: each graph dynamo captures trains through TVM.

Dynamo brings what ``add_tvm_dispatch`` cannot: graph breaks (a model ``torch.export`` cannot
take whole still runs, each captured piece compiled), its guards and recompiles, its automatic
dynamic shapes, and the integrations built on it (DDP's bucketed graphs, compiled models handed
to a Trainer). The bridge brings the rest: every graph dynamo passes becomes a module
(:class:`~tvmbridge.dynamo.graph.GraphCall`) dispatched as ``add_tvm_dispatch`` dispatches a
model, so a graph's forward and backward run on TVM through the same pipeline, with the same
net: the first call of each compiled variant is checked against PyTorch, and a graph the bridge
cannot convert runs PyTorch with a warning (``explain()`` says why).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..caches import CACHES
from ..errors import FallbackWarning, caller_stacklevel
from ..options import CompileOptions, with_overrides
from ..runtime.dispatch import Dispatcher, add_tvm_dispatch, dispatcher_of
from .graph import GraphCall, InputPlan, OutputPlan, inline_bodies, prepared
from .split import grad_modes, needs_split, split

# The backend's defaults where they differ from add_tvm_dispatch's: a graph that cannot be
# converted runs PyTorch (with a warning) instead of failing the user's torch.compile.
BACKEND_DEFAULTS: dict[str, Any] = {"fallback": True}

# torch.compile's ``mode`` names inductor's choices; the bridge compiles the same way under each,
# and says what stands for the one that asks for more (``max-autotune``: a tuned database).
_TUNED = "tune ahead with `python -m tvmbridge tune` and pass options={'tuning_db': <its directory>}"
MODES: dict[str, str] = {"reduce-overhead": "", "max-autotune": _TUNED, "max-autotune-no-cudagraphs": _TUNED}


def check_mode(mode: str | None, said: set[str]) -> None:
    """A ``torch.compile(mode=...)`` the backend takes: known modes compile as the default does (said
    once per mode and backend, ``said`` holding those said, with what gives the mode's effect here);
    another is an error naming them."""
    if mode is None or mode == "default":
        return
    if mode not in MODES:
        raise ValueError(
            f"torch.compile(mode={mode!r}) is not a mode tvmbridge knows; it takes 'default', "
            f"{', '.join(repr(m) for m in MODES)} (all compile alike) and CompileOptions fields as options={{...}}"
        )
    if mode not in said:
        said.add(mode)
        how = f": {MODES[mode]}" if MODES[mode] else ""
        warnings.warn(
            f"tvmbridge compiles torch.compile(mode={mode!r}) as the default mode (modes choose inductor's "
            f"settings){how}",
            UserWarning,
            stacklevel=caller_stacklevel(),
        )


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm``'s graph (node names and meta kept) over the same attributes."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


class CompiledGraph:
    """What the backend returns for one graph: calls it with the graph's inputs, in TVM. Its first
    call compiles; where that fails at ops the bridge cannot convert, the graph is split there
    (PyTorch runs those ops, TVM the rest) instead of running PyTorch whole."""

    def __init__(self, gm: torch.fx.GraphModule, options: CompileOptions, grad_enabled: bool | None = None) -> None:
        self.options = options
        # dynamo captured the graph under this grad mode (and guards on it); a piece, its barrier's
        self.grad_enabled = torch.is_grad_enabled() if grad_enabled is None else grad_enabled
        self.source = _copy(gm)  # as dynamo gave it (``prepared`` rewrites gm): what a split cuts
        self.plan = InputPlan.of(gm)
        self.outputs = OutputPlan.of(gm, self.plan)
        self.module = GraphCall(prepared(gm, self.plan, self.outputs), self.plan, self.grad_enabled)
        opts = options.replace(dynamic=self.plan.dynamic_option()) if options.dynamic == "auto" else options
        add_tvm_dispatch(self.module, options=opts)
        self.dispatcher: Dispatcher = dispatcher_of(self.module)
        self.split: SplitGraph | None = None
        self._first_done = False
        self._first_lock = threading.Lock()

    note = ""  # where the graph came from, when not from dynamo directly

    def __call__(self, *args: Any) -> Any:
        """The graph's outputs for one call, as dynamo expects them."""
        if not self._first_done:
            self._first_call(args)
        if self.split is not None:
            return self.split.forward(*args)
        out = self.dispatcher(*self.plan.call_args(args))
        return self.outputs.full(out, args, self.plan) if self.outputs.rebuilt else out

    def _first_call(self, args: tuple) -> None:
        """Compile for the first call; split the graph at the nodes a conversion failure names."""
        with self._first_lock:
            if self._first_done:
                return
            error = self.dispatcher.try_compile(*self.plan.call_args(args))
            if error is not None and not self.options.fallback:
                raise error  # fallback=False: no op left to PyTorch without the user's say
            names = {n.name for n in self.source.graph.nodes}
            named = frozenset(error.sources).intersection(names) if error is not None else frozenset()
            if named:
                try:
                    self.split = SplitGraph(
                        self.source,
                        self.options,
                        named,
                        f"; the bridge cannot convert them: {error}",
                        self.grad_enabled,
                    )
                except Exception:  # noqa: BLE001 - a graph that cannot be cut runs PyTorch whole, as it would unsplit
                    named = frozenset()
            if named:
                assert self.split is not None  # cut above
                if self.options.warn_on_fallback:
                    warnings.warn(
                        f"tvmbridge: a torch.compile graph is split at {', '.join(self.split.kept)}: "
                        f"PyTorch runs {'it' if len(named) == 1 else 'them'}, TVM the rest ({error})",
                        FallbackWarning,
                        stacklevel=caller_stacklevel(),
                    )
            # done once a compile was tried (a call no variant could run, under a dispatch mode, tries later)
            d = self.dispatcher
            self._first_done = bool(self.split is not None or d.variants or d.failures)

    def explain(self) -> str:
        if self.split is not None:
            pieces = "\n".join(f"  {name}: {piece.explain()}" for name, piece in self.split.pieces.items())
            text = f"split around {', '.join(self.split.kept)}{self.split.why}\n{pieces}"
        else:
            text = self.dispatcher.explain()
        return f"{self.note}\n{text}" if self.note else text


class _Piece(torch.nn.Module):
    """A compiled piece where the split graph calls its submodule."""

    def __init__(self, compiled: CompiledGraph) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any) -> Any:
        """The piece's outputs (the split graph calls it where the piece's nodes were)."""
        return self.compiled(*args)


class SplitGraph:
    """A graph cut where PyTorch must run (``split``): each piece between compiled as a graph of
    its own (all pieces wrapped, or none: a failure leaves the graph whole)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        options: CompileOptions,
        named: frozenset[str] = frozenset(),
        why: str = "",
        grad_enabled: bool | None = None,
    ) -> None:
        fused, names, self.kept = split(gm, named)
        self.why = why
        modes = grad_modes(fused, torch.is_grad_enabled() if grad_enabled is None else grad_enabled)
        self.pieces = {name: CompiledGraph(getattr(fused, name), options, modes[name]) for name in names}
        for name, piece in self.pieces.items():
            piece.note = f"a piece of a graph split around {', '.join(self.kept)} (PyTorch runs those)"
            setattr(fused, name, _Piece(piece))
        fused.recompile()
        self.forward = fused.forward


class Backend:
    """A dynamo backend with fixed :class:`CompileOptions`; keeps the graphs it compiled (for
    ``explain()``)."""

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self.graphs: list[CompiledGraph] = []
        self.refused: list[str] = []  # why each graph that runs PyTorch as a whole does
        self._lock = threading.Lock()
        self._said_modes: set[str] = set()  # torch.compile modes warned about (once each)

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        """What dynamo runs for ``gm`` (``mode``/``options``: torch.compile's, passed on to a backend object)."""
        with self._lock:
            check_mode(mode, self._said_modes)
        if options:
            raise ValueError(
                "torch.compile(backend=<a tvmbridge backend object>, options=...): the object's options are "
                f"fixed when it is made: tvmbridge.compile_backend(**{options!r})"
            )
        try:
            inline_bodies(gm)
            if needs_split(gm):
                return self._split(gm)
            compiled = CompiledGraph(gm, self.options)
        except Exception as exc:  # noqa: BLE001 - a graph we cannot even wrap runs as dynamo gave it
            if not self.options.fallback:
                raise
            with self._lock:
                self.refused.append(f"{len(gm.graph.nodes)}-node graph runs PyTorch: {exc}")
            if self.options.warn_on_fallback:
                warnings.warn(f"tvmbridge: a torch.compile graph runs PyTorch: {exc}", FallbackWarning, stacklevel=2)
            return gm.forward
        with self._lock:
            self.graphs.append(compiled)
        return compiled

    def _split(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        """Each compilable piece compiled as a graph of its own; PyTorch runs the rest."""
        graph = SplitGraph(gm, self.options)
        with self._lock:
            self.graphs.extend(graph.pieces.values())
        return graph.forward

    def explain(self) -> str:
        """Per graph dynamo passed: what its calls ran and why."""
        with self._lock:
            graphs, refused = list(self.graphs), list(self.refused)
        if not graphs and not refused:
            return "no graph compiled yet"
        lines = [f"graph {i}: {g.explain()}" for i, g in enumerate(graphs, 1)]
        return "\n".join(lines + [f"not compiled: {why}" for why in refused])

    def __deepcopy__(self, memo: dict[int, Any]) -> Backend:
        """The backend itself: ``copy.deepcopy`` of a model compiled with it (timm's ``ModelEmaV2``,
        a checkpointed best model) copies dynamo's context, which holds the backend; graphs the
        copy compiles are kept with the others'."""
        return self

    def reset(self) -> None:
        """Forget the graphs (``torch._dynamo.reset()`` calls this: its compiled code is gone)."""
        with self._lock:
            self.graphs.clear()
            self.refused.clear()


def compile_backend(options: CompileOptions | None = None, **overrides: Any) -> Backend:
    """A ``torch.compile`` backend with these options: ``torch.compile(model,
    backend=tvmbridge.compile_backend(memory_budget=0.3))``. Defaults as ``add_tvm_dispatch``,
    except ``fallback=True``."""
    if options is None:
        overrides = {**BACKEND_DEFAULTS, **overrides}
    opts = with_overrides(options, overrides)
    if isinstance(opts.dynamic, dict):
        raise ValueError(
            "dynamic={...} names a module's arguments; under torch.compile, dynamo decides the dynamic "
            "dims: use torch.compile(..., dynamic=True) or torch._dynamo.mark_dynamic instead"
        )
    return Backend(opts)


def tvmbridge(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The backend registered as ``"tvmbridge"``: ``torch.compile(model, backend="tvmbridge",
    options={"memory_budget": 0.3})`` passes ``options`` as :class:`CompileOptions` fields;
    ``mode`` as :func:`check_mode` says."""
    return _backend_for(options or {})(gm, example_inputs, mode=mode)


def _backend_for(options: dict[str, Any]) -> Backend:
    """The backend for these options, one per options (``CACHES.backends``), so that graphs
    compiled alike share it."""
    key = repr(sorted(options.items()))
    backend = CACHES.backends.get_or_make(key, lambda: compile_backend(**options))
    assert backend is not None  # compile_backend makes one
    return backend
