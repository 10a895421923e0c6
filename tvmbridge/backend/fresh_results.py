"""Results that are constants, copied into fresh memory at every call.

A Relax function may return a constant (an integer the symbolic trace folded from a static size:
the length a ``DynamicCache`` layer counts). The VM returns its constant pool's own array, and
DLPack hands PyTorch that memory: the same tensor on every call, so a caller's in-place edit (a
generation loop advancing its cache) changed what every later call returned. Each such result
is returned through a copy kernel instead, whose output the VM allocates per call as for any
other kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, te


def _constant_of(expr: relax.Expr, bound: dict[relax.Var, relax.Expr]) -> relax.Expr | None:
    """The constant ``expr`` is, through the bindings that rename it; None if it is none."""
    while isinstance(expr, relax.Var) and expr in bound:
        expr = bound[expr]
    is_tensor = isinstance(expr, tvm.ir.expr.Constant) and hasattr(expr.value, "shape")  # not a prim value
    return expr if is_tensor else None


def _type_of(constant: relax.Expr) -> relax.TensorType:
    data = constant.value  # the constant's array
    return relax.TensorType([int(d) for d in data.shape], str(data.dtype))


def _copy_kernel(ty: relax.TensorType) -> tvm.tirx.PrimFunc:
    shape = [int(d) for d in ty.shape.values]
    source = te.placeholder(shape, ty.dtype, name="source")
    copied = te.compute(shape, lambda *i: source(*i), name="copied")
    return te.create_prim_func([source, copied])


def _fresh(func: relax.Function, kernel_for: Callable[[relax.TensorType], tvm.ir.GlobalVar]) -> relax.Function | None:
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return None
    bound = {b.var: b.value for block in body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)}
    result = body.body
    while isinstance(result, relax.Var) and isinstance(bound.get(result), relax.Tuple):
        result = bound[result]  # the function returns a variable bound to its result tuple
    fields = list(result.fields) if isinstance(result, relax.Tuple) else [result]
    constants = [_constant_of(f, bound) for f in fields]
    if not any(c is not None for c in constants):
        return None
    bindings: list[relax.Binding] = []
    for i, c in enumerate(constants):
        if c is not None:
            ty = _type_of(c)
            copy = relax.Var(f"fresh_result{i}", ty)
            bindings.append(relax.VarBinding(copy, relax.call_tir(kernel_for(ty), relax.Tuple([c]), out_ty=ty)))
            fields[i] = copy
    new_result = relax.Tuple(fields) if isinstance(result, relax.Tuple) else fields[0]
    seq = relax.SeqExpr([*body.blocks, relax.BindingBlock(bindings)], new_result)
    return relax.Function(func.params, seq, func.ret_ty, func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.FreshConstantResults")
def fresh_constant_results(mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Every Relax function's constant results (module docstring) returned through a copy."""
    bb = relax.BlockBuilder(mod)
    kernels: dict[str, tvm.ir.GlobalVar] = {}

    def kernel_for(ty: relax.TensorType) -> tvm.ir.GlobalVar:
        name = "tvmbridge_fresh_" + "_".join([str(ty.dtype), *(str(d) for d in ty.shape.values)])
        if name not in kernels:
            kernels[name] = bb.add_func(_copy_kernel(ty).with_attr("global_symbol", name), name)
        return kernels[name]

    updated = {
        gv: new
        for gv, func in mod.functions_items()
        if isinstance(func, relax.Function) and (new := _fresh(func, kernel_for)) is not None
    }
    out = bb.get()
    for gv, new in updated.items():
        out[gv] = new  # not ``bb.update_func``: its deduplication map lacks functions it did not add
    return relax.transform.Normalize()(out) if updated else out
