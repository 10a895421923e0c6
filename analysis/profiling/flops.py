"""`FlopCounter`, a dispatch mode that counts FLOPs per aten op, per module, forward and backward.

The formulas it adds up, their convention (a multiply-add is 2 FLOPs, as
``torch.utils.flop_counter``) and the estimates made for the ops PyTorch counts as zero
(pointwise, reductions, softmax, norms, pooling) are in ``flop_formulas``; their public names are
importable from here too, where callers have always found them.
"""

from __future__ import annotations

import copy
import weakref
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from analysis.profiling.flop_formulas import (  # noqa: F401 - the formulas' API, re-exported here
    RawFormula,
    count_op,
    formula_for,
    is_torch_counted,
    register_flop_formula,
)
from analysis.tensors import tensor_leaves

aten = torch.ops.aten

# Ops that only query metadata; PyTorch's counter lets them through untouched, so do we.
METADATA_OPS = {
    aten.sym_is_contiguous.default,
    aten.is_contiguous.default,
    aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default,
    aten.is_non_overlapping_and_dense.default,
    aten.size.default,
    aten.sym_size.default,
    aten.stride.default,
    aten.sym_stride.default,
    aten.storage_offset.default,
    aten.sym_storage_offset.default,
    aten.numel.default,
    aten.sym_numel.default,
    aten.dim.default,
    torch.ops.prim.layout.default,
}


def in_backward() -> bool:
    """True while the autograd engine runs a backward (including checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


def dispatch_and_count(
    mode: TorchDispatchMode, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, int]:
    """Run ``func`` below ``mode`` like PyTorch's counter does: decompose composite ops first."""
    if func is not torch.ops.prim.device.default:
        with mode:
            r = func.decompose(*args, **kwargs)
        if r is not NotImplemented:
            return r, 0
    out = func(*args, **kwargs)
    return out, count_op(func, args, kwargs, out)


GLOBAL = "Global"


def _copy_counts(counts: dict) -> dict:
    """A copy of nested dicts of counts (a defaultdict keeps its factory)."""
    c = copy.copy(counts)
    for k, v in counts.items():
        if isinstance(v, dict):
            c[k] = _copy_counts(v)
    return c


def _max_into(dst: dict, src: dict) -> None:
    """``dst[k] = max(dst[k], src[k])`` over nested dicts of counts."""
    for k, v in src.items():
        if not isinstance(v, dict):
            dst[k] = max(dst.get(k, 0), v)
        elif k in dst:
            _max_into(dst[k], v)
        else:
            dst[k] = _copy_counts(v)


class CountingDispatchMode(TorchDispatchMode):
    """Runs every aten op the way PyTorch's counter does (composites decomposed first, metadata
    queries passed through) and hands each executed op to :meth:`on_op`.

    Higher-order ops come here too (PyTorch's counter handles ``torch.cond``; without this they
    would raise): see :meth:`run_higher_order`.
    """

    supports_higher_order_operators = True

    def on_op(self, packet: Any, flops: int, out: Any) -> None:
        raise NotImplementedError

    def tally(self) -> dict:
        """The dict (nested dicts) of counts :meth:`on_op` adds to; ``torch.cond`` keeps the
        larger branch's in it."""
        raise NotImplementedError

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in METADATA_OPS:
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self.run_higher_order(func, args, kwargs or {})
        out, flops = dispatch_and_count(self, func, args, kwargs or {})
        self.on_op(func._overloadpacket, flops, out)
        return out

    def run_higher_order(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``torch.cond`` runs both branches and keeps, per module and op, the larger count, as
        PyTorch's counter does (an upper bound: fake tensors cannot say which branch a real run
        takes). Other higher-order ops run their eager kernel, whose aten ops are counted."""
        if func is torch.ops.higher_order.cond:
            _pred, true_fn, false_fn, operands = args
            counts = self.tally()
            before = _copy_counts(counts)
            with self:
                out = true_fn(*operands)
            after_true = _copy_counts(counts)
            counts.clear()
            counts.update(before)
            with self:
                false_fn(*operands)
            _max_into(counts, after_true)
            return out
        kernel = func.py_kernels.get(torch._C.DispatchKey.CompositeExplicitAutograd)
        if kernel is None:
            raise NotImplementedError(f"FLOP counting: no rule for higher-order op {func.name()}")
        with self:
            return kernel(*args, **kwargs)


class _CountingDispatch(CountingDispatchMode):
    def __init__(self, counter: FlopCounter) -> None:
        super().__init__()
        self.counter = counter

    def on_op(self, packet: Any, flops: int, out: Any) -> None:
        if flops:
            self.counter._add(packet, flops)

    def tally(self) -> dict:
        return self.counter.counts


class _GradFnTagger(TorchFunctionMode):
    """Marks the autograd nodes each torch call creates with the module stack that created them.

    The autograd engine then tells us (node pre-hook) which module's forward made the backward
    work it is doing. Unlike hooks on module inputs, this also works for ``autograd.grad`` on
    leaves, which is what ``torch.func.jacrev``/``hessian`` run.
    """

    def __init__(self, counter: FlopCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        c = self.counter
        if not c._fw_stack or in_backward():
            return func(*args, **kwargs)
        stop = {t.grad_fn for t in tensor_leaves((args, kwargs)) if t.grad_fn is not None}
        out = func(*args, **kwargs)
        stack = tuple(c._fw_stack)
        todo: list[torch.autograd.graph.Node | None] = [t.grad_fn for t in tensor_leaves(out) if t.grad_fn is not None]
        while todo:
            fn = todo.pop()
            if fn is None or fn in stop or fn in c._tagged:
                continue
            c._tagged.add(fn)
            fn.register_prehook(partial(c._enter_backward_node, stack))
            fn.register_hook(c._exit_backward_node)
            todo.extend(f for f, _ in fn.next_functions)
        return out


class FlopCounter:
    """Count FLOPs per aten op and per module, separately for forward and backward.

    ``with FlopCounter() as fc: loss = model(x).sum(); loss.backward()`` then ``fc.total()``,
    ``fc.total("backward")``, ``fc.by_op()``, ``fc.by_module()``, ``print(fc.table())``.
    Module names are PyTorch's counter's (``torch.utils.module_tracker``): the first module
    seen gets its class name, every module below it its fully qualified path, list items included
    (``BertModel.encoder.layer.0.attention.self.query``); ``Global`` holds everything. An op
    counts for every module running when it runs (not for a container that never runs, such as
    a ModuleList). Backward FLOPs go to the modules whose forward created the autograd node;
    checkpoint recomputation is counted (in the backward phase, as that is when it runs), and so
    is ``torch.func`` (vmap, jacrev, hessian).
    """

    def __init__(self, display: bool = False, depth: int = 2) -> None:
        self.display = display
        self.depth = depth
        # module -> phase -> op packet -> flops
        self.counts: dict[str, dict[str, dict[Any, int]]] = defaultdict(
            lambda: {"forward": defaultdict(int), "backward": defaultdict(int)}
        )
        self._fw_stack: list[str] = []
        self._bw_stack: tuple[str, ...] = ()
        self._tagged: set[Any] = set()
        # module -> name, and the modules whose subtree is named (weak: models may be freed)
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._named_below: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._handles: list[Any] = []
        self._modes: list[Any] = []

    # --- module tracking
    def _name(self, mod: torch.nn.Module) -> str:
        """The name ``ModuleTracker._get_mod_name`` gives (so per-module counts key like
        FlopCounterMode's): the whole subtree is named when a module is first seen, so items of a
        ModuleList/ModuleDict, whose container never runs, still get their full path."""
        name = self._names.get(mod)
        if name is None:
            name = self._names[mod] = type(mod).__name__
        if mod not in self._named_below:
            for child_name, child in mod.named_children():
                self._names[child] = f"{name}.{child_name}"
                self._name(child)
            self._named_below.add(mod)
        return name

    def _pre_hook(self, mod: torch.nn.Module, args: Any) -> None:
        self._fw_stack.append(self._name(mod))

    def _post_hook(self, mod: torch.nn.Module, args: Any, out: Any) -> None:
        """Registered ``always_call``: it also runs when the forward raises, as a non-reentrant
        checkpoint's recomputation does once it has what the backward needs (early stop);
        otherwise the re-run modules would stay on the stack and take all later work."""
        name = self._name(mod)
        # pop the innermost occurrence (recomputation may re-enter a module during backward)
        for i in range(len(self._fw_stack) - 1, -1, -1):
            if self._fw_stack[i] == name:
                del self._fw_stack[i]
                break

    def _enter_backward_node(self, stack: tuple[str, ...], grad_outputs: Any) -> None:
        self._bw_stack = stack

    def _exit_backward_node(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self._bw_stack = ()

    def _parents(self, bw: bool) -> set[str]:
        """The modules an op counts for: those whose forward runs and, in backward, those whose
        forward made the autograd node being run. A checkpoint recomputation runs inside the
        node that needs it: its work goes to the modules re-run and to the ones enclosing them,
        not to that node's own module (a sibling, often the block's last LayerNorm)."""
        parents = {GLOBAL, *self._fw_stack}
        if bw and self._fw_stack:
            head = self._fw_stack[0]
            parents.update(m for m in self._bw_stack if head.startswith(m + "."))
        elif bw:
            parents.update(self._bw_stack)
        return parents

    def _add(self, packet: Any, flops: int) -> None:
        bw = in_backward()
        phase = "backward" if bw else "forward"
        for p in self._parents(bw):
            self.counts[p][phase][packet] += flops

    def __enter__(self) -> FlopCounter:
        self.counts.clear()
        self._handles = [
            register_module_forward_pre_hook(self._pre_hook),
            register_module_forward_hook(self._post_hook, always_call=True),
        ]
        self._modes = [_GradFnTagger(self), _CountingDispatch(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._modes, self._handles = [], []
        self._tagged.clear()
        self._fw_stack.clear()
        self._bw_stack = ()
        if self.display and exc[0] is None:
            print(self.table())

    # --- results
    def by_op(self, module: str = GLOBAL, phase: str | None = None) -> dict[Any, int]:
        """FLOPs per op packet for one module (default everything), one phase or both."""
        out: dict[Any, int] = defaultdict(int)
        for ph, ops in self.counts.get(module, {}).items():
            if phase is None or ph == phase:
                for op, n in ops.items():
                    out[op] += n
        return dict(out)

    def total(self, phase: str | None = None, module: str = GLOBAL) -> int:
        """Total FLOPs (``phase`` "forward", "backward" or None for both)."""
        return sum(self.by_op(module, phase).values())

    def by_module(self, phase: str | None = None) -> dict[str, int]:
        return {m: self.total(phase, m) for m in self.counts}

    def table(self, depth: int | None = None) -> str:
        """Module tree with forward/backward FLOPs, in human units."""
        from analysis.units import human_flops

        depth = self.depth if depth is None else depth
        rows = [("Module", "Forward", "Backward", "Total")]
        for m in sorted(self.counts, key=lambda s: (s != GLOBAL, s)):
            d = 0 if m == GLOBAL else m.count(".") + 1
            if d > depth:
                continue
            f, b = self.total("forward", m), self.total("backward", m)
            rows.append(("  " * d + m, human_flops(f), human_flops(b), human_flops(f + b)))
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join(r[0].ljust(w[0]) + "".join("  " + r[i].rjust(w[i]) for i in range(1, 4)) for r in rows)

    def __iter__(self) -> Iterator[str]:
        return iter(self.counts)
