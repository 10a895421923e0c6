"""FLOP formulas per aten op, and `FlopCounter`, a dispatch mode that counts them per module.

Convention: a multiply-add is 2 FLOPs (the convention of ``torch.utils.flop_counter``, whose
formula registry is reused as is for what it covers: mm, addmm, bmm, baddbmm, convolution and its
backward, attention kernels). PyTorch counts every other op as zero; here they get a count too:

* pointwise arithmetic (ops tagged ``torch.Tag.pointwise``): 1 FLOP per output element per
  elementary operation (``+ - * /``, compare, ``exp``, ``erf``, ``tanh``... each count 1), so most
  are 1 per element; composite activations count the operations of their textbook formula
  (``_POINTWISE_COST``). Copies, casts and selects (``clone``, ``where``, ``masked_fill``) are 0.
* reductions (``torch.Tag.reduction``): 1 per input element (``var``/``std``: 3).
* softmax 5 (``_softmax`` and the math SDPA's ``_safe_softmax``), its backward 4, log-softmax 5
  and 3 per element; layer/batch norm 5 per element to normalise plus 1 each for the affine
  weight and bias, backward 8 per element for the input gradient and 2/1 for weight/bias;
  pooling 1 per window element; embedding backward 1 per gradient element (scatter-add).

The counts that only this module makes are estimates of work, not measurements: they are stated
so that totals are comparable between models, not to be exact to the instruction.
"""
from __future__ import annotations

import copy
import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry as _torch_flop_registry

from analysis.tensors import tensor_leaves

aten = torch.ops.aten

# A formula gets the op's args, kwargs and output (real, fake or meta tensors) and returns FLOPs.
RawFormula = Callable[[tuple[Any, ...], dict[str, Any], Any], int]

_EXTRA_FORMULAS: dict[Any, RawFormula] = {}
_FORMULA_CACHE: dict[Any, RawFormula | None] = {}

# Ops that only query metadata; PyTorch's counter lets them through untouched, so do we.
METADATA_OPS = {
    aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
    aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default,
    aten.size.default, aten.sym_size.default, aten.stride.default, aten.sym_stride.default,
    aten.storage_offset.default, aten.sym_storage_offset.default, aten.numel.default,
    aten.sym_numel.default, aten.dim.default, torch.ops.prim.layout.default,
}


def register_flop_formula(targets: Any, formula: RawFormula | None = None) -> Any:
    """Register ``formula(args, kwargs, out) -> int`` for one op packet or a list of them.

    Usable as a decorator. Overrides the built-in rules of this module (not PyTorch's registry,
    which stays untouched so that ``torch.utils.flop_counter.FlopCounterMode`` keeps its meaning).
    """

    def register(f: RawFormula) -> RawFormula:
        for t in targets if isinstance(targets, (list, tuple)) else [targets]:
            if not isinstance(t, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
                raise TypeError(f"register_flop_formula: expected an aten op packet, got {t!r}")
            _EXTRA_FORMULAS[t] = f
        _FORMULA_CACHE.clear()
        return f

    return register if formula is None else register(formula)


def _numel(x: Any) -> int:
    return sum(t.numel() for t in tensor_leaves(x))


def _first_numel(args: tuple[Any, ...]) -> int:
    ts = tensor_leaves(args)
    return ts[0].numel() if ts else 0


# --- pointwise ---------------------------------------------------------------------------------
_ZERO_COST = {
    aten.clone, aten.where, aten.masked_fill, aten.masked_fill_, aten._to_copy, aten.copy,
    aten.copy_, aten.fill, aten.fill_, aten.zero_, aten.lift_fresh_copy, aten.alias,
    aten.bernoulli, aten.bernoulli_, aten.zeros_like, aten.ones_like, aten.empty_like,
}
_POINTWISE_COST: dict[Any, int] = {
    aten.gelu: 5,  # x * 0.5 * (1 + erf(x / sqrt 2))
    aten.gelu_backward: 9,  # g * (cdf + x * pdf): cdf 4, pdf 3 (square, scale, exp), 2 mul/add
    aten.sigmoid: 4, aten.sigmoid_backward: 3,  # g * y * (1 - y)
    aten.tanh_backward: 3,  # g * (1 - y * y)
    aten.silu: 5, aten.silu_backward: 8,
    aten.addcmul: 2, aten.addcmul_: 2, aten.addcdiv: 2, aten.addcdiv_: 2,
    aten.lerp: 3, aten.lerp_: 3,
}


def _pointwise(cost: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    return cost * _numel(out)


# --- specific formulas ------------------------------------------------------------------------
def _per_input_element(cost: int) -> RawFormula:
    return lambda args, kwargs, out: cost * _first_numel(args)


def _per_output_element(cost: int) -> RawFormula:
    return lambda args, kwargs, out: cost * _numel(out if not isinstance(out, tuple) else out[0])


def _mean(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    return _first_numel(args) + _numel(out)  # sum, then one division per result


def _norm_forward(x: torch.Tensor, weight: Any, bias: Any) -> int:
    n = x.numel()
    return 5 * n + (n if weight is not None else 0) + (n if bias is not None else 0)


def _layer_norm(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    x, _shape, weight, bias = (list(args) + [None, None, None])[:4]
    return _norm_forward(x, weight, bias)


def _batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    x, weight, bias = args[0], args[1], args[2]
    training = kwargs.get("training", args[5] if len(args) > 5 and isinstance(args[5], bool) else True)
    if not training:  # (x - mean) * invstd with stored statistics
        n = x.numel()
        return 2 * n + (n if weight is not None else 0) + (n if bias is not None else 0)
    return _norm_forward(x, weight, bias)


def _norm_backward(n: int, mask: list[bool]) -> int:
    return (8 * n if mask[0] else 0) + (2 * n if mask[1] else 0) + (n if mask[2] else 0)


def _layer_norm_backward(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    mask = kwargs.get("output_mask", args[7] if len(args) > 7 else [True, True, True])
    return _norm_backward(args[0].numel(), list(mask))


def _batch_norm_backward(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    mask = kwargs.get("output_mask", args[-1] if isinstance(args[-1], (list, tuple)) else [True] * 3)
    return _norm_backward(args[0].numel(), list(mask))


def _pool(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    kernel = args[1] if len(args) > 1 else kwargs["kernel_size"]
    o = out[0] if isinstance(out, tuple) else out
    return o.numel() * math.prod(kernel)


def _var(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    return 3 * _first_numel(args)


for _packet, _formula in {
    aten._softmax: _per_output_element(5),
    # the math SDPA's softmax (fully masked rows give 0, not NaN). Its backward is the plain
    # ``_softmax_backward_data`` (4 per element), so the forward counts as a softmax too: PyTorch
    # counts neither, and counting only the backward would make a layer's backward/forward ratio
    # depend on the attention kernel. Zeroing masked rows is a select, which costs 0 here.
    aten._safe_softmax: _per_output_element(5),
    aten._softmax_backward_data: _per_output_element(4),
    aten._log_softmax: _per_output_element(5),
    aten._log_softmax_backward_data: _per_output_element(3),
    aten.native_layer_norm: _layer_norm,
    aten.native_layer_norm_backward: _layer_norm_backward,
    aten.native_batch_norm: _batch_norm,
    aten._native_batch_norm_legit: _batch_norm,
    aten._native_batch_norm_legit_functional: _batch_norm,
    aten._native_batch_norm_legit_no_training: lambda a, k, o: _batch_norm(a[:5] + (False,), {}, o),
    aten.native_batch_norm_backward: _batch_norm_backward,
    aten.max_pool2d_with_indices: _pool,
    aten.max_pool3d_with_indices: _pool,
    aten.avg_pool2d: _pool,
    aten.avg_pool3d: _pool,
    aten.max_pool2d_with_indices_backward: _per_input_element(1),
    aten.avg_pool2d_backward: _per_input_element(1),
    aten._adaptive_avg_pool2d: _per_input_element(1),
    aten._adaptive_avg_pool2d_backward: _per_input_element(1),
    aten.embedding_dense_backward: _per_input_element(1),
    aten.mean: _mean,
    aten.var: _var,
    aten.std: _var,
    aten.var_mean: _var,
    aten.std_mean: _var,
}.items():
    _EXTRA_FORMULAS[_packet] = _formula


def _wrap_torch_formula(f: Callable[..., int]) -> RawFormula:
    return lambda args, kwargs, out: int(f(*args, **kwargs, out_val=out))


def formula_for(func: Any) -> RawFormula | None:
    """The formula counting ``func`` (an OpOverload), or None when the op costs nothing."""
    try:
        return _FORMULA_CACHE[func]
    except KeyError:
        pass
    packet = getattr(func, "_overloadpacket", func)
    f: RawFormula | None
    if func in _EXTRA_FORMULAS:
        f = _EXTRA_FORMULAS[func]
    elif packet in _EXTRA_FORMULAS:
        f = _EXTRA_FORMULAS[packet]
    elif packet in _torch_flop_registry:
        f = _wrap_torch_formula(_torch_flop_registry[packet])
    elif packet in _ZERO_COST:
        f = None
    elif torch.Tag.pointwise in getattr(func, "tags", ()):
        f = partial(_pointwise, _POINTWISE_COST.get(packet, 1))
    elif torch.Tag.reduction in getattr(func, "tags", ()):
        f = _per_input_element(1)
    else:
        f = None
    _FORMULA_CACHE[func] = f
    return f


def count_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one executed aten op."""
    f = formula_for(func)
    return 0 if f is None else f(args, kwargs, out)


def is_torch_counted(packet: Any) -> bool:
    """True for ops PyTorch's own FlopCounterMode counts (the ones our totals must equal)."""
    return packet in _torch_flop_registry


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
        todo = [t.grad_fn for t in tensor_leaves(out) if t.grad_fn is not None]
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
        return "\n".join(
            r[0].ljust(w[0]) + "".join("  " + r[i].rjust(w[i]) for i in range(1, 4)) for r in rows
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self.counts)
