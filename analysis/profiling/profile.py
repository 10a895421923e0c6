"""`symbolic_profile`: shape propagation plus a per-node memory and FLOP profile, on fake tensors.

Every node of the GraphModule is run once on fake tensors with the real autograd machinery:

* forward: the op runs under a dispatch mode that counts FLOPs (`analysis.flops`) and records
  every tensor the aten ops create, and under ``saved_tensors_hooks`` that see what autograd keeps
  for the backward;
* backward: nodes whose output reaches the graph output with a gradient are differentiated
  (``autograd.grad`` on fake tensors, reverse order), so backward FLOPs are those of the kernels
  PyTorch would really run (no weight gradient for frozen weights, no input gradient for inputs
  that need none).

Memory is accounted per storage (views and in-place results cost nothing new; a tensor saved by
two nodes is counted once; parameters and buffers are never activations). Results go to
``node.meta["profile"]`` (`NodeProfile`), ``node.meta["val"]``/``["tensor_meta"]`` (shapes) and
``gm.meta["profile"]`` (`ProfileSummary`).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.node import Node, map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map

from analysis.profiling.flops import CountingDispatchMode
from analysis.profiling.meta import find_fake_mode, to_fake
from analysis.tensors import storage_key, tensor_leaves

aten = torch.ops.aten

__all__ = ["NodeProfile", "ProfileSummary", "symbolic_profile", "measure_saved_bytes"]

_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.imatmul,
}


@dataclass
class NodeProfile:
    """What one node costs. Sizes in bytes, FLOPs with 2 per multiply-add."""

    output_bytes: int = 0  # new storage the node's outputs occupy (0 for views, in-place ops)
    temp_bytes: int = 0  # storage created and dropped inside the node
    param_bytes: int = 0  # parameters and buffers the node reads (call_module, get_attr)
    backward_bytes: int = 0  # activations this node makes autograd keep (first saver counts)
    accumulated_bytes: int = 0  # activation memory alive after the node (incl. saved ones)
    incremental_bytes: int = 0  # accumulated minus that of the previous node
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_flops_by_op: dict[Any, int] = field(default_factory=dict)
    bwd_flops_by_op: dict[Any, int] = field(default_factory=dict)


@dataclass
class ProfileSummary:
    fwd_flops: int
    bwd_flops: int
    peak_activation_bytes: int  # max over nodes of live activations + that node's outputs/temps
    backward_bytes: int  # sum of NodeProfile.backward_bytes
    param_bytes: int  # unique parameter and buffer storage of the module
    fwd_flops_by_op: dict[Any, int]
    bwd_flops_by_op: dict[Any, int]


class _NodeDispatch(CountingDispatchMode):
    """Counts FLOPs and records created tensors while one node runs."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: dict[Any, int] = defaultdict(int)
        self.created: list[torch.Tensor] = []

    def on_op(self, packet: Any, flops: int, out: Any) -> None:
        if flops:
            self.flops[packet] += flops
        self.created.extend(tensor_leaves(out))

    def tally(self) -> dict:
        return self.flops


def _mutates_first_arg(node: Node, gm: torch.fx.GraphModule) -> bool:
    t = node.target
    if node.op == "call_method":
        return str(t).endswith("_") and not str(t).endswith("__")
    if node.op == "call_function":
        name = getattr(t, "__name__", "")
        return (
            t in _INPLACE_OPERATORS
            or (name.endswith("_") and not name.endswith("__"))
            or node.kwargs.get("inplace") is True
        )
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(t)), "inplace", False) is True
    return False


def _bind_inputs(gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[Node, Any]:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(args) > len(phs):
        raise TypeError(f"symbolic_profile: {len(args)} inputs for {len(phs)} placeholders")
    bound: dict[Node, Any] = {}
    for i, n in enumerate(phs):
        name = str(n.target).lstrip("*")
        if i < len(args):
            bound[n] = args[i]
        elif name in kwargs or n.name in kwargs:
            bound[n] = kwargs.get(name, kwargs.get(n.name))
        elif n.args:
            bound[n] = n.args[0]
        elif str(n.target).startswith("**"):
            bound[n] = {}
        elif str(n.target).startswith("*"):
            bound[n] = ()
        else:
            raise TypeError(f"symbolic_profile: no value for input {n.target!r}")
    return bound


def symbolic_profile(
    gm: torch.fx.GraphModule, *args: Any, verbose: bool = False, **kwargs: Any
) -> torch.fx.GraphModule:
    """Profile ``gm`` on fake versions of ``args`` (real, meta-device or fake tensors).

    Nothing runs on real data and no real memory is allocated for activations. Returns ``gm``
    with ``node.meta["profile"]`` on every node and ``gm.meta["profile"]`` (`ProfileSummary`);
    ``verbose=True`` prints `profile_table`.
    """
    state = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    mode: FakeTensorMode = (
        find_fake_mode(tensor_leaves((args, kwargs)) + list(state.values()))
        or gm.meta.get("fake_mode")
        or FakeTensorMode(allow_non_fake_inputs=True)
    )
    fake_state = {k: to_fake(v, mode) for k, v in state.items()}
    bound = {n: to_fake(v, mode) for n, v in _bind_inputs(gm, args, kwargs).items()}
    swap = any(not isinstance(v, FakeTensor) for v in state.values())
    if swap:
        with _reparametrize_module(gm, fake_state):
            _Profiler(gm, mode, fake_state, bound).run()
    else:
        _Profiler(gm, mode, fake_state, bound).run()
    if verbose:
        from analysis.profiling.table import profile_table  # the table reads this module's types

        print(profile_table(gm))
    return gm


@dataclass
class _Liveness:
    """Activation storages alive between nodes: the running total, its peak, who holds what."""

    nbytes: dict[StorageWeakRef, int]
    live: set[StorageWeakRef] = field(default_factory=set)
    total: int = 0
    peak: int = 0
    holders: dict[StorageWeakRef, set[Node]] = field(default_factory=lambda: defaultdict(set))

    def add(self, keys: Iterable[StorageWeakRef]) -> None:
        for k in keys:
            self.live.add(k)
            self.total += self.nbytes[k]

    def drop(self, k: StorageWeakRef) -> None:
        self.live.discard(k)
        self.total -= self.nbytes[k]


def summarize(nodes: list[Node], peak: int, param_bytes: int) -> ProfileSummary:
    """The graph's totals from its nodes' profiles."""
    fwd: dict[Any, int] = defaultdict(int)
    bwd: dict[Any, int] = defaultdict(int)
    for n in nodes:
        for op, f in n.meta["profile"].fwd_flops_by_op.items():
            fwd[op] += f
        for op, f in n.meta["profile"].bwd_flops_by_op.items():
            bwd[op] += f
    return ProfileSummary(
        fwd_flops=sum(fwd.values()),
        bwd_flops=sum(bwd.values()),
        peak_activation_bytes=peak,
        backward_bytes=sum(n.meta["profile"].backward_bytes for n in nodes),
        param_bytes=param_bytes,
        fwd_flops_by_op=dict(fwd),
        bwd_flops_by_op=dict(bwd),
    )


class _Profiler:
    def __init__(
        self,
        gm: torch.fx.GraphModule,
        mode: FakeTensorMode,
        fake_state: dict[str, torch.Tensor],
        bound: dict[Node, Any],
    ) -> None:
        self.gm, self.mode, self.bound = gm, mode, bound
        self.param_keys = {storage_key(t) for t in fake_state.values()}
        self.param_bytes = sum(
            t.untyped_storage().nbytes() for t in {k: t for t in fake_state.values() for k in [storage_key(t)]}.values()
        )
        self.alias: dict[StorageWeakRef, StorageWeakRef] = {}
        self.nbytes: dict[StorageWeakRef, int] = {}
        self.saved: set[StorageWeakRef] = set()
        self.env: dict[Node, Any] = {}

    def canon(self, t: torch.Tensor) -> StorageWeakRef:
        k = storage_key(t)
        k = self.alias.get(k, k)
        if k not in self.nbytes:
            self.nbytes[k] = t.untyped_storage().nbytes()
        return k

    def keys_of(self, x: Any) -> set[StorageWeakRef]:
        return {self.canon(t) for t in tensor_leaves(x)}

    def run(self) -> None:
        """Pass 1 forward (shapes, memory, forward FLOPs), pass 2 backward FLOPs, then totals."""
        nodes = list(self.gm.graph.nodes)
        peak, pending_bw = self._forward_pass(nodes)
        grad_live = self._grad_live(nodes)
        self._backward_pass(pending_bw, grad_live)
        self._count_grad_accumulation(grad_live)
        self.gm.meta["profile"] = summarize(nodes, peak, self.param_bytes)

    def _forward_pass(self, nodes: list[Node]) -> tuple[int, list[tuple[Node, list, list]]]:
        index = {n: i for i, n in enumerate(nodes)}
        dies_at: dict[int, list[Node]] = defaultdict(list)
        for n in nodes:
            dies_at[max((index[u] for u in n.users), default=index[n])].append(n)
        mem = _Liveness(self.nbytes)
        prev_acc = 0
        pending_bw: list[tuple[Node, list[torch.Tensor], list[torch.Tensor]]] = []
        for i, node in enumerate(nodes):
            prof = NodeProfile()
            node.meta["profile"] = prof
            if node.op == "output":
                continue
            out, leaves, saved, created = self.run_node(node, prof)
            self.env[node] = out
            node.meta["val"] = out
            node.meta["tensor_meta"] = map_aggregate(
                out, lambda v: _extract_tensor_metadata(v) if isinstance(v, torch.Tensor) else None
            )
            self._account(node, prof, out, saved, created, mem)
            for dead in dies_at.get(i, []):
                self._release(dead, mem)
            prof.accumulated_bytes = mem.total
            prof.incremental_bytes = mem.total - prev_acc
            prev_acc = mem.total
            if leaves:
                pending_bw.append((node, tensor_leaves(out), leaves))
        return mem.peak, pending_bw

    def _account(
        self,
        node: Node,
        prof: NodeProfile,
        out: Any,
        saved: set[StorageWeakRef],
        created: list[torch.Tensor],
        mem: _Liveness,
    ) -> None:
        """Output, temporary and saved-for-backward bytes of one node; the peak while it runs."""
        out_keys = self.keys_of(out) - self.param_keys
        in_keys = self.keys_of([self.env[a] for a in node.all_input_nodes])
        new_out = out_keys - mem.live
        prof.output_bytes = sum(self.nbytes[k] for k in new_out)
        kept_inside: set[StorageWeakRef] = set()  # saved intermediates that are no output
        for k in saved - self.param_keys:
            if k in self.saved:
                continue
            self.saved.add(k)
            prof.backward_bytes += self.nbytes[k]
            if k not in out_keys and k not in mem.live:
                kept_inside.add(k)
        temp = {self.canon(t) for t in created} - out_keys - in_keys - saved - mem.live - self.param_keys
        prof.temp_bytes = sum(self.nbytes[k] for k in temp)
        mem.peak = max(
            mem.peak, mem.total + prof.output_bytes + prof.temp_bytes + sum(self.nbytes[k] for k in kept_inside)
        )
        mem.add(new_out | kept_inside)
        for k in out_keys:
            mem.holders[k].add(node)

    def _release(self, dead: Node, mem: _Liveness) -> None:
        """``dead`` has no later reader: its storages die unless saved or held by another node."""
        for k in self.keys_of(self.env.get(dead)) - self.param_keys:
            mem.holders[k].discard(dead)
            if not mem.holders[k] and k not in self.saved and k in mem.live:
                mem.drop(k)

    def _backward_pass(self, pending_bw: list[tuple[Node, list, list]], grad_live: set[Node]) -> None:
        """Backward FLOPs, reverse order, only where a gradient arrives."""
        for node, outs, leaves in reversed(pending_bw):
            if node not in grad_live:
                continue
            outs = [o for o in outs if o.requires_grad and o.grad_fn is not None]
            if not outs:
                continue
            d = _NodeDispatch()
            with self.mode, d:
                torch.autograd.grad(outs, leaves, grad_outputs=[torch.empty_like(o) for o in outs], allow_unused=True)
            prof = node.meta["profile"]
            prof.bwd_flops_by_op = dict(d.flops)
            prof.bwd_flops = sum(d.flops.values())

    def _count_grad_accumulation(self, grad_live: set[Node]) -> None:
        """A tensor used by k differentiable consumers gets k gradients: k - 1 adds (the
        autograd engine's buffer accumulation, which no single node's backward contains)."""
        for node in grad_live:
            v = self.env.get(node)
            if not isinstance(v, torch.Tensor) or not v.is_floating_point():
                continue
            edges = 0
            for u in node.users:
                if u in grad_live or u.op == "output":
                    flat = tree_flatten((u.args, u.kwargs))[0]
                    edges += sum(1 for a in flat if a is node)
            if edges > 1:
                prof = node.meta["profile"]
                flops = (edges - 1) * v.numel()
                prof.bwd_flops_by_op[aten.add] = prof.bwd_flops_by_op.get(aten.add, 0) + flops
                prof.bwd_flops += flops

    def _grad_live(self, nodes: list[Node]) -> set[Node]:
        """Nodes whose outputs receive a gradient when the graph outputs are differentiated."""

        def needs_grad(n: Node) -> bool:
            return any(t.requires_grad for t in tensor_leaves(self.env.get(n)))

        live: set[Node] = set()
        for n in reversed(nodes):
            if n.op == "output" or n in live:
                live.update(a for a in n.all_input_nodes if needs_grad(a))
        return live

    # --- one node
    def run_node(self, node: Node, prof: NodeProfile) -> tuple[Any, list[torch.Tensor], set, list]:
        """Run one node on fake tensors: (output, autograd leaves, saved storages, created tensors)."""
        if node.op == "placeholder":
            return self.bound[node], [], set(), []
        if node.op == "get_attr":
            return self._constant(node, prof), [], set(), []
        args, kwargs, leaves = self._prepare_inputs(node)
        saved: set[StorageWeakRef] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(self.canon(t))
            return t

        d = _NodeDispatch()
        with self.mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), d:
            out = self._call(node, args, kwargs)
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            ps = list(mod.parameters()) + list(mod.buffers())
            prof.param_bytes = sum(p.untyped_storage().nbytes() for p in {id(p): p for p in ps}.values())
            leaves += [p for p in mod.parameters() if p.requires_grad]
        prof.fwd_flops_by_op = dict(d.flops)
        prof.fwd_flops = sum(d.flops.values())
        return out, leaves, saved, d.created

    def _constant(self, node: Node, prof: NodeProfile) -> Any:
        obj: Any = self.gm
        for atom in str(node.target).split("."):
            obj = getattr(obj, atom)
        val = to_fake(obj, self.mode)
        prof.param_bytes = sum(t.untyped_storage().nbytes() for t in tensor_leaves(val))
        for t in tensor_leaves(val):  # constants are not activations either
            self.param_keys.add(storage_key(t))
        return val

    def _prepare_inputs(self, node: Node) -> tuple[tuple, dict, list[torch.Tensor]]:
        """The node's arguments with every grad-requiring tensor made an autograd leaf (so its
        backward can be run alone); an in-place op's target is a clone sharing the storage key."""
        leaves: list[torch.Tensor] = []
        memo: dict[int, torch.Tensor] = {}
        inplace = _mutates_first_arg(node, self.gm)

        def leafify(t: Any, is_first: bool) -> Any:
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                return t
            if id(t) in memo:
                return memo[id(t)]
            if storage_key(t) in self.param_keys and t.is_leaf:
                leaf = t
                leaves.append(leaf)
            else:
                leaf = t.detach().requires_grad_(True)
                leaves.append(leaf)
                if is_first and inplace:  # in-place on a leaf is illegal: clone, same storage
                    with self.mode:
                        c = leaf.clone()
                    self.alias[storage_key(c)] = self.canon(t)
                    leaf = c
            memo[id(t)] = leaf
            return leaf

        def prep(a: Any, is_first: bool) -> Any:
            if not isinstance(a, Node):
                return a
            v = self.env[a]
            if not isinstance(v, (tuple, list, dict)):
                return leafify(v, is_first)
            if not any(t.requires_grad for t in tensor_leaves(v)):
                return v  # the very object, as fx's Interpreter passes it: ``kwargs.pop`` works
            return tree_map(lambda t: leafify(t, is_first), v)  # keeps dict/list/ModelOutput types

        first = node.args[0] if node.args else None
        args = tuple(
            prep(a, a is first and j == 0) if isinstance(a, Node) else map_aggregate(a, lambda x: prep(x, False))
            for j, a in enumerate(node.args)
        )
        kwargs = {k: map_aggregate(v, lambda x: prep(x, False)) for k, v in node.kwargs.items()}
        return args, kwargs, leaves

    def _call(self, node: Node, args: tuple, kwargs: dict) -> Any:
        if node.op == "call_function":
            assert callable(node.target)  # the function itself
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        if node.op == "call_module":
            return self.gm.get_submodule(str(node.target))(*args, **kwargs)
        raise ValueError(f"unknown node op {node.op}")


# --- reporting ---------------------------------------------------------------------------------
def measure_saved_bytes(fn: Any, *args: Any, exclude: Iterable[torch.Tensor] = (), **kwargs: Any) -> tuple[Any, int]:
    """Run ``fn`` for real and return (output, bytes autograd keeps for the backward).

    Counted with ``saved_tensors_hooks`` over unique storages, leaving out the storages of
    ``exclude`` (pass the model's parameters and buffers). This is the ground truth the profile's
    ``backward_bytes`` is compared against.
    """
    skip = {storage_key(t) for t in exclude}
    seen: dict[StorageWeakRef, int] = {}
    keep: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = storage_key(t)
        if k not in skip and k not in seen:
            seen[k] = t.untyped_storage().nbytes()
            keep.append(t)  # hold it so the storage id is not reused while we count
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, sum(seen.values())
