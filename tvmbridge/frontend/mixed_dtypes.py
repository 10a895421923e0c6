"""Make PyTorch's implicit dtype mixing explicit in a traced graph, so every op converts to Relax
ops of one dtype.

A graph traced under autocast mixes dtypes: ``native_layer_norm`` gets a bfloat16 input with
float32 weights (PyTorch's mixed-type kernel computes in float32 and returns bfloat16), ``add``
gets a bfloat16 and a float32 tensor (type promotion). Relax's operators require one dtype. This
pass inserts ``_to_copy`` casts where PyTorch's kernel converts internally: normalizations compute
in their widest input dtype and cast their results to the traced dtype; every other op casts its
inputs to its result dtype (the promoted one, as TensorIterator does). Matrix products and
convolutions do not promote: PyTorch raises for mixed inputs (a float64 batch into a float32
model), and so does this pass, where the fake tensors of the trace let it through.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.fx import Graph, Node

from ..errors import ConversionError

aten = torch.ops.aten

# kernels that accept a low-precision input with float32 parameters and compute in float32
MIXED_TYPE_NORMS = frozenset(
    {
        aten.native_layer_norm.default,
        aten.native_group_norm.default,
        aten.native_batch_norm.default,
        aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit.no_stats,
        aten._native_batch_norm_legit_no_training.default,
        aten._native_batch_norm_legit_functional.default,
    }
)


# kernels that require one dtype (no promotion): a mixed call is an error in PyTorch
SAME_DTYPE_KERNELS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.mv.default,
        aten.addmv.default,
        aten.dot.default,
        aten.convolution.default,
        aten._convolution.default,
    }
)


def _float_val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) and val.is_floating_point() else None


def _cast(graph: Graph, value: Node, dtype: torch.dtype, before: Node) -> Node:
    val = value.meta["val"]
    with graph.inserting_before(before):
        cast = graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
    with val.fake_mode:
        cast.meta["val"] = val.to(dtype)
    return cast


def _retype(node: Node, dtype: torch.dtype) -> None:
    val = node.meta["val"]
    with val.fake_mode:
        node.meta["val"] = val.to(dtype)


def make_dtype_mixing_explicit(graph: Graph) -> int:
    """Insert the casts PyTorch's kernels do internally (see the module docstring); returns how
    many were inserted. The graph is changed in place."""
    inserted = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        inserted += _promote_integer_inputs(graph, node)
        vals = {a: v for a in node.all_input_nodes if (v := _float_val(a)) is not None}
        dtypes = {v.dtype for v in vals.values()}
        if len(dtypes) < 2:
            continue
        widest = functools.reduce(torch.promote_types, dtypes)
        if node.target in SAME_DTYPE_KERNELS:
            names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise ConversionError(
                "trace",
                f"{node.target} gets {names} inputs, which PyTorch refuses (its "
                "kernels need one dtype): convert the inputs to the module's dtype, or the "
                "module to the inputs'",
                op=str(node.target),
            )
        if node.target in MIXED_TYPE_NORMS:
            compute = widest
        else:
            out = _float_val(node)
            compute = out.dtype if out is not None else widest
        for a, v in vals.items():
            if v.dtype != compute:
                node.replace_input_with(a, _cast(graph, a, compute, node))
                inserted += 1
        if node.target in MIXED_TYPE_NORMS:
            inserted += _cast_norm_results(graph, node, compute)
    return inserted


def _promote_integer_inputs(graph: Graph, node: Node) -> int:
    """A pointwise op with a floating result computes in that dtype whatever its integer or bool
    inputs are (``log(int)``, ``int / int``, ``x * bool_mask``): PyTorch promotes them, Relax
    needs the cast. Selector arguments (``where``'s condition, ``masked_fill``'s mask) stay."""
    if torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return 0
    out = _float_val(node)
    if out is None or node.target in (aten._to_copy.default, aten.clone.default):
        return _typed_int_scalars(graph, node)
    schema_args = getattr(getattr(node.target, "_schema", None), "arguments", [])
    names = [a.name for a in schema_args]
    inserted = _typed_int_scalars(graph, node)
    for i, a in enumerate(node.args):
        if not isinstance(a, Node):
            continue
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.is_floating_point() or val.is_complex():
            continue
        if i < len(names) and names[i] in ("condition", "mask"):
            continue
        node.replace_input_with(a, _cast(graph, a, out.dtype, node))
        inserted += 1
    return inserted


def _typed_int_scalars(graph: Graph, node: Node) -> int:
    """A Python int beside an integer tensor (``pos // 2`` on int64) as a 0-d tensor of that
    tensor's dtype: TVM's frontend makes every int scalar an int32 constant, which Relax's
    binary ops refuse beside int64 (PyTorch computes in the tensor's dtype)."""
    ints = [
        a.meta["val"].dtype
        for a in node.args
        if isinstance(a, Node)
        and isinstance(a.meta.get("val"), torch.Tensor)
        and not (a.meta["val"].is_floating_point() or a.meta["val"].is_complex() or a.meta["val"].dtype == torch.bool)
    ]
    if not ints or ints[0] == torch.int32:
        return 0
    schema = getattr(getattr(node.target, "_schema", None), "arguments", [])
    inserted = 0
    for i, a in enumerate(node.args):
        if type(a) is int and i < len(schema) and str(schema[i].type) == "Tensor":  # a Scalar stays one
            with graph.inserting_before(node):
                const = graph.call_function(aten.scalar_tensor.default, (a,), {"dtype": ints[0]})
            like = next(x.meta["val"] for x in node.all_input_nodes if isinstance(x.meta.get("val"), torch.Tensor))
            with like.fake_mode:
                const.meta["val"] = torch.scalar_tensor(a, dtype=ints[0], device=like.device)
            node.update_arg(i, const)
            inserted += 1
    return inserted


def _cast_norm_results(graph: Graph, node: Node, compute: torch.dtype) -> int:
    """The norm now returns ``compute`` throughout: each result PyTorch gives in another dtype is
    cast back to it after its ``getitem``."""
    inserted = 0
    for item in list(node.users):
        val = _float_val(item)
        if item.target is not operator.getitem or val is None or val.dtype == compute:
            continue
        traced_dtype = val.dtype
        users = list(item.users)
        _retype(item, compute)
        after = item.next
        cast = _cast(graph, item, traced_dtype, after)
        for user in users:
            user.replace_input_with(item, cast)
        inserted += 1
    return inserted
