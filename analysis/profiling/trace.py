"""`symbolic_trace`: torch.fx tracing where every proxy carries a fake (meta) value.

Plain ``torch.fx.symbolic_trace`` cannot follow shape-dependent Python control flow
(``if x.dim() == 3:``, ``len(x.shape)``, ``a, b = x.shape``) because a proxy has no value. Here each
node's value is computed on fake tensors while tracing, so ``bool``, ``len``, ``iter`` and
``int`` of a proxy answer from that value and the branch the meta argument takes is traced. The
value is kept in ``node.meta["val"]`` (PyTorch's convention for fake values).

Functions the tracer cannot run on fake tensors (data-dependent Python, numpy, ...) get a rule
with `register_shape_impl`; registered functions are also kept as leaves (one node each).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import Node, Target, map_aggregate
from torch.fx.proxy import Attribute, Proxy

from analysis.profiling.meta import find_fake_mode, to_fake
from analysis.registry import Registry

__all__ = ["MetaTraceError", "register_shape_impl", "symbolic_trace", "MetaTracer"]

# function or nn.Module class -> rule taking the fake inputs (and the module first for classes)
_SHAPE_IMPLS: Registry[Any, Callable[..., Any]] = Registry("shape rule")

# tensor attributes that are answered from the fake value instead of becoming graph nodes
_CONCRETE_ATTRS = {
    "dtype",
    "device",
    "ndim",
    "is_cuda",
    "is_sparse",
    "is_quantized",
    "layout",
    "requires_grad",
    "is_leaf",
}


class MetaTraceError(RuntimeError):
    """A node's fake value could not be computed."""


def register_shape_impl(target: Any, impl: Callable[..., Any] | None = None) -> Any:
    """Register how to compute the output (fake tensors) of ``target`` from fake inputs.

    ``target`` is a function (traced as one leaf node; it must be referenced as a module-level
    global, as with ``torch.fx.wrap``) or an ``nn.Module`` subclass (kept as a leaf module;
    ``impl(module, *args, **kwargs)``). Usable as a decorator:
    ``@register_shape_impl(my_fn)\ndef _(x): return x.new_empty(x.shape[0], 4)``.
    """

    def register(f: Callable[..., Any]) -> Callable[..., Any]:
        _SHAPE_IMPLS[target] = f  # a later rule for the same target replaces it (a notebook cell run again)
        return f

    return register if impl is None else register(impl)


class MetaProxy(Proxy):
    """A proxy that answers Python questions (bool, len, iteration) from its fake value."""

    @property
    def meta_value(self) -> Any:
        if "val" not in self.node.meta:
            raise MetaTraceError(f"node {self.node.name} has no meta value")
        return self.node.meta["val"]

    def __len__(self) -> int:
        return len(self.meta_value)

    def __index__(self) -> int:
        return operator.index(_concrete(self, "index"))

    def __int__(self) -> int:
        return int(_concrete(self, "int"))

    def __float__(self) -> float:
        return float(_concrete(self, "float"))

    def dim(self) -> int:
        return self.meta_value.dim()

    def __getattr__(self, k: str) -> Any:
        if k in _CONCRETE_ATTRS and isinstance(self.node.meta.get("val"), torch.Tensor):
            return getattr(self.node.meta["val"], k)
        return MetaAttribute(self, k)


class MetaAttribute(MetaProxy, Attribute):
    """``proxy.attr`` (``x.shape``, ``x.view``): a MetaProxy whose node is made on first use."""


class MetaTracer(torch.fx.Tracer):
    """fx Tracer that computes a fake value for every node as it creates it."""

    def __init__(
        self, fake_mode: FakeTensorMode, meta_args: dict[str, Any], placeholder_defaults: dict[str, Any]
    ) -> None:
        autowrap = tuple(f for f in _SHAPE_IMPLS if callable(f) and not isinstance(f, type))
        super().__init__(autowrap_functions=autowrap)
        self.fake_mode = fake_mode
        self.meta_args = meta_args
        self.placeholder_defaults = placeholder_defaults
        self._in_meta = False

    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        # fx reads the signature of the unwrapped function but would call the wrapper with it
        # (transformers wraps layer forwards for gradient checkpointing): trace the inner one.
        return super().create_args_for_root(inspect.unwrap(root_fn), is_module, concrete_args)

    def proxy(self, node: Node) -> Proxy:
        return MetaProxy(node, self)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return type(m) in _SHAPE_IMPLS or super().is_leaf_module(m, qualname)

    def call_module(
        self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self._in_meta:  # a leaf module computing its meta value calls its children directly
            return forward(*args, **kwargs)
        self._orig_forward = forward
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self._in_meta:  # module forwards run for meta values see the real attributes
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_proxy(
        self,
        kind: str,
        target: Target,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
        proxy_factory_fn: Callable[[Node], Proxy] | None = None,
    ) -> Proxy:
        rv = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind != "output":
            rv.node.meta["val"] = self._meta(kind, target, args, kwargs, rv.node)
        return rv

    def _meta(self, kind: str, target: Target, args: tuple[Any, ...], kwargs: dict[str, Any], node: Node) -> Any:
        if kind == "placeholder":
            name = str(target)
            if name in self.meta_args:
                return self.meta_args[name]
            base = name.rsplit("_", 1)[0]  # fx names concrete placeholders `<arg>_<n>`
            return self.placeholder_defaults.get(name, self.placeholder_defaults.get(base))

        def unwrap(a: Any) -> Any:
            return a.node.meta.get("val") if isinstance(a, Proxy) else a

        margs, mkwargs = map_aggregate(args, unwrap), map_aggregate(kwargs, unwrap)
        self._in_meta = True
        try:
            with self.fake_mode:
                if kind == "get_attr":
                    return to_fake(self._fetch(str(target)), self.fake_mode)
                margs, mkwargs = to_fake((margs, mkwargs), self.fake_mode)
                if kind == "call_function":
                    assert callable(target)  # the function itself
                    fn = _SHAPE_IMPLS[target] if target in _SHAPE_IMPLS else target
                    return fn(*margs, **mkwargs)
                if kind == "call_method":
                    return getattr(margs[0], str(target))(*margs[1:], **mkwargs)
                if kind == "call_module":
                    mod = self.root.get_submodule(str(target))
                    impl = _SHAPE_IMPLS.get(type(mod))
                    if impl:
                        return impl(mod, *margs, **mkwargs)
                    return self._orig_forward(*margs, **mkwargs)
        except MetaTraceError:
            raise
        except Exception as e:
            what = getattr(target, "__name__", str(target))
            raise MetaTraceError(
                f"cannot compute the meta value of {kind} {what!r} (node {node.name}): "
                f"{type(e).__name__}: {e}. If it cannot run on fake tensors, register a rule with "
                f"analysis.register_shape_impl({what}, fn)"
            ) from e
        finally:
            self._in_meta = False
        raise MetaTraceError(f"unknown node kind {kind}")

    def _fetch(self, qualname: str) -> Any:
        obj: Any = self.root
        for atom in qualname.split("."):
            obj = getattr(obj, atom)
        return obj

    def to_bool(self, obj: Proxy) -> bool:
        return bool(_concrete(obj, "bool"))

    def iter(self, obj: Proxy) -> Iterator:
        proxy: Any = obj  # fx adds Proxy's operators (getitem, ...) at run time, unseen by its stubs
        return iter([proxy[i] for i in range(len(_meta_of(obj)))])

    def keys(self, obj: Proxy) -> Any:
        return _meta_of(obj).keys()


def _concrete(p: Proxy, what: str) -> Any:
    """A Python value from the meta value, refusing values that depend on tensor data."""
    val = _meta_of(p)
    if isinstance(val, torch.Tensor):
        raise MetaTraceError(
            f"{what}() of tensor {p.node.name} depends on its data, which tracing on fake tensors "
            "cannot know; make the function doing it a leaf with analysis.register_shape_impl"
        )
    return val


def _meta_of(p: Proxy) -> Any:
    val = p.node.meta.get("val")
    if val is None and "val" not in p.node.meta:
        raise MetaTraceError(f"control flow on {p.node.name}, which has no meta value")
    return val


def symbolic_trace(
    model: torch.nn.Module, meta_args: dict[str, Any] | None = None, concrete_args: dict[str, Any] | None = None
) -> torch.fx.GraphModule:
    """Trace ``model`` into a GraphModule whose nodes carry fake values (``node.meta["val"]``).

    ``meta_args`` maps forward parameter names to example tensors (real, meta-device or fake;
    only shape/dtype/device/requires_grad are used). ``concrete_args`` fixes other parameters to
    Python values. Parameters given by neither take their default (so ``mask=None`` traces the
    ``None`` branch); a parameter without default and without value is an error.
    """
    meta_args = dict(meta_args or {})
    concrete_args = dict(concrete_args or {})
    sig = inspect.signature(model.forward)
    overlap = set(meta_args) & set(concrete_args)
    if overlap:
        raise ValueError(f"arguments given both as meta_args and concrete_args: {sorted(overlap)}")
    unknown = set(meta_args) - set(sig.parameters)
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        raise ValueError(f"{type(model).__name__}.forward has no parameter(s) {sorted(unknown)}")

    defaults: dict[str, Any] = {}
    for name, p in sig.parameters.items():
        if name in meta_args:
            continue
        if p.kind is p.VAR_KEYWORD:  # stays a placeholder whose meta value is an empty dict
            defaults["**" + name] = {}
        elif p.kind is p.VAR_POSITIONAL:
            defaults["*" + name] = ()
        elif name in concrete_args:
            defaults[name] = concrete_args[name]
        elif p.default is not inspect.Parameter.empty:
            concrete_args[name] = p.default
            defaults[name] = p.default
        else:
            raise ValueError(
                f"argument {name!r} of {type(model).__name__}.forward needs a value in meta_args or concrete_args"
            )
    extra_kwargs = {k: v for k, v in meta_args.items() if k not in sig.parameters}
    if extra_kwargs:
        raise ValueError(f"meta_args for **kwargs are not supported: {sorted(extra_kwargs)}")

    mode = find_fake_mode(list(meta_args.values()) + list(model.parameters())[:1]) or FakeTensorMode(
        allow_non_fake_inputs=True
    )
    fake_args = {k: to_fake(v, mode) for k, v in meta_args.items()}

    tracer = MetaTracer(mode, fake_args, defaults)
    graph = tracer.trace(model, concrete_args=concrete_args or None)
    name = type(model).__name__
    for n in graph.nodes:  # fx keeps the signature default on specialised inputs: use the value
        if n.op == "placeholder" and str(n.target).rsplit("_", 1)[0] in concrete_args:
            value = concrete_args[str(n.target).rsplit("_", 1)[0]]
            if value is None or isinstance(value, (bool, int, float, str)):
                n.args = (value,)
    gm = torch.fx.GraphModule(tracer.root, graph, name)
    gm.meta["fake_mode"] = mode
    return gm
