"""A convolution's two gradients as one library call, where a step needs both.

The gradient writes a convolution's input gradient (a transposed convolution of the output
gradient) and its weight gradient (a convolution over the input regrouped per group) apart, and
``OffloadConvolutions`` sends each to PyTorch on its own. Eager's autograd makes one
``convolution_backward`` call for both: one oneDNN backward whose two halves share their setup,
over the input as it is. Two calls cost a CNN's backward about half again its convolution time
(ghostnet's depthwise convolutions most: their input is regrouped by a TVM kernel first, and back
by the library call). Here each pair of offloaded calls that belongs to one forward convolution
(the same output gradient, the transposed convolution's kernel as the weight, the regrouped data
read back to the forward's input, and the same geometry) becomes one
``kernels.conv.conv2d_backward`` call; its two results replace the two. A gradient the step does
not need (a frozen weight, the input image) was never written, and the other stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import relax

from ..ir import is_op
from ..kernels.conv import CONV2D_BACKWARD, CONV2D_TRANSPOSE, CONV2D_WEIGHT_GRAD


def _packed(value: relax.Expr, name: str) -> bool:
    return is_op(value, "relax.call_pure_packed") and str(value.args[0].global_symbol) == name


def _ints(shape: relax.Expr) -> list[int]:
    return [int(v) for v in shape.values]


def _same_shape(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = getattr(a.ty, "shape", None), getattr(b.ty, "shape", None)
    return sa is not None and sb is not None and tvm_ffi.structural_equal(sa, sb)


def _op_arg(bound: dict[relax.Var, relax.Expr], var: relax.Expr, op: str) -> relax.Call | None:
    value = bound.get(var) if isinstance(var, relax.Var) else None
    return value if value is not None and is_op(value, op) else None


def forward_input(bound: dict[relax.Var, relax.Expr], data: relax.Expr, groups: int) -> relax.Expr | None:
    """The forward convolution's input that a weight gradient's data was regrouped from:
    ``reshape(permute_dims(reshape(x, (n, G, C/G, h, w)), [1, 0, 2, 3, 4]), (G*n, C/G, h, w))``;
    with one group that is ``x`` as it is stored, so the data itself."""
    if groups == 1:
        return data
    outer = _op_arg(bound, data, "relax.reshape")
    swap = _op_arg(bound, outer.args[0], "relax.permute_dims") if outer is not None else None
    inner = _op_arg(bound, swap.args[0], "relax.reshape") if swap is not None else None
    if swap is None or inner is None or [int(a) for a in swap.attrs.axes] != [1, 0, 2, 3, 4]:
        return None
    split = inner.ty.shape
    if len(split) != 5 or not isinstance(split[1], tvm.tirx.IntImm) or int(split[1]) != groups:
        return None
    return inner.args[0]


@dataclass(frozen=True)
class _Pair:
    transpose: relax.Var  # the input gradient
    weight_grad: relax.Var  # the weight gradient call
    result: relax.Var  # the weight gradient as the step reads it (the call, or its slice to the kernel)
    call: relax.Call  # the joint call


def _sliced_result(value: relax.Call, w: relax.Expr, var: relax.Var, uses: dict, bound: dict) -> relax.Var | None:
    """The variable holding the weight gradient at the kernel's size: the call itself, or the one
    slice of it to ``w``'s size (a strided convolution's extent computed larger)."""
    if _same_shape(value, w):
        return var
    readers = uses.get(var, [])
    if len(readers) != 1 or readers[0] not in bound:
        return None
    cut = bound[readers[0]]
    if not is_op(cut, "relax.strided_slice") or not _same_shape(cut, w):
        return None
    begins, steps = _tuple_ints(cut.args[2]), _tuple_ints(cut.args[4]) if len(cut.args) > 4 else []
    return readers[0] if begins is not None and not any(begins) and steps is not None and set(steps) <= {1} else None


def _tuple_ints(expr: relax.Expr) -> list[int] | None:
    """A slice's begins or strides, where all are integers."""
    fields = expr.fields if isinstance(expr, relax.Tuple) else getattr(expr, "values", None)
    if fields is None:
        return None
    try:
        return [int(getattr(f, "value", f)) for f in fields]
    except (TypeError, ValueError):
        return None


class _Block:
    """What matching reads of a block: each variable's value, its position (parameters first),
    and the bindings reading it."""

    def __init__(self, block: relax.DataflowBlock, params: list[relax.Var]) -> None:
        self.bound = {b.var: b.value for b in block.bindings}
        self.where = {p: -1 for p in params} | {b.var: i for i, b in enumerate(block.bindings)}
        self.uses = relax.analysis.udchain(block)  # a variable -> the variables bound to its readers

    def match(self, t: relax.Var, wg: relax.Var) -> _Pair | None:
        """The joint call for input gradient ``t`` and weight gradient ``wg`` (which read the same
        output gradient), where they are one convolution's, else None."""
        (_, _, w, shape), (_, data, g, vec) = self.bound[t].args, self.bound[wg].args
        vec_t, vec_w = _ints(shape), _ints(vec)
        strides, (ph, pw), dilation, groups = vec_t[0:2], vec_t[2:4], vec_t[6:8], vec_t[8]
        # the weight gradient's convolution: the forward's stride and dilation trade places
        if vec_w[0:2] != dilation or vec_w[6:8] != strides or vec_w[2:6] != [ph, pw, ph, pw] or vec_w[8] != groups:
            return None
        x = forward_input(self.bound, data, groups)
        result = _sliced_result(self.bound[wg], w, wg, self.uses, self.bound) if x is not None else None
        first = min(self.where[t], self.where[wg])
        if x is None or result is None or not _same_shape(x, self.bound[t]):
            return None
        if not all(self.where.get(v, first) < first for v in (g, w, x)):  # defined before both
            return None
        attrs = relax.ShapeExpr([*strides, ph, pw, *dilation, groups, vec_t[12], vec_w[12]])
        ty = relax.TupleType([t.ty, result.ty])
        return _Pair(t, wg, result, relax.op.call_pure_packed(CONV2D_BACKWARD, g, x, w, attrs, ty_args=ty))


def _pairs(block: relax.DataflowBlock, params: list[relax.Var]) -> list[_Pair]:
    transposes: dict[relax.Expr, list[relax.Var]] = {}
    weight_grads: list[relax.VarBinding] = []
    for b in block.bindings:
        if _packed(b.value, CONV2D_TRANSPOSE):
            transposes.setdefault(b.value.args[1], []).append(b.var)
        elif _packed(b.value, CONV2D_WEIGHT_GRAD):
            weight_grads.append(b)
    if not transposes or not weight_grads:
        return []  # a block without both (a forward, a model of few convolutions): no reads indexed
    facts = _Block(block, params)
    found: list[_Pair] = []
    taken: set[relax.Var] = set()
    for b in weight_grads:
        for t in transposes.get(b.value.args[2], []):
            pair = None if t in taken else facts.match(t, b.var)
            if pair is not None:
                found.append(pair)
                taken.add(t)
                break
    return found


def pair_block(block: relax.DataflowBlock, params: list[relax.Var]) -> tuple[relax.DataflowBlock, int]:
    """``block`` with each pair replaced by the joint call, placed where the first of the two was."""
    pairs = _pairs(block, params)
    if not pairs:
        return block, 0
    at = {p.transpose: p for p in pairs} | {p.weight_grad: p for p in pairs}
    dropped = {p.result for p in pairs}
    out: list[relax.Binding] = []
    emitted: set[int] = set()
    for b in block.bindings:
        pair = at.get(b.var)
        if pair is not None and id(pair) not in emitted:
            emitted.add(id(pair))
            joint = relax.DataflowVar("conv_grads", relax.TupleType([pair.transpose.ty, pair.result.ty]))
            out.append(relax.VarBinding(joint, pair.call))
            out.append(relax.VarBinding(pair.transpose, relax.TupleGetItem(joint, 0)))
            out.append(relax.VarBinding(pair.result, relax.TupleGetItem(joint, 1)))
        elif pair is None and b.var not in dropped:
            out.append(b)
    return relax.DataflowBlock(out), len(pairs)


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.PairConvolutionGradients")
class PairConvolutionGradients:
    """Each convolution's two offloaded gradients as one call (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        out, paired = mod.clone(), 0
        for gv, func in mod.functions_items():
            body = func.body if isinstance(func, relax.Function) else None
            if not isinstance(body, relax.SeqExpr) or len(body.blocks) != 1:
                continue
            block, n = pair_block(body.blocks[0], list(func.params))
            if n:
                paired += n
                out[gv] = relax.Function(
                    func.params, relax.SeqExpr([block], body.body), func.ret_ty, func.is_pure, func.attrs
                )
        return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(out)) if paired else mod
