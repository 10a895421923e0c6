"""One kernel for each family of kernels that differ only in their shapes.

A network repeats its blocks at several widths and resolutions (EfficientNet's 16 blocks, a
ResNet's stages): after fusion each block's BatchNorm, activation and gradient kernels are the
same code with other sizes, and TVM builds each copy separately (most of a CNN's compile time).
:class:`ShareKernelsAcrossShapes` finds kernels whose TIR is the same but for integer constants,
writes one kernel where the constants that vary are expressions of the parameters' sizes (bound
from the tensors it is called with), and points every call at it.

The shared kernel is each member by construction: a constant that varies is replaced only by an
expression that gives, for every member's sizes, that member's value (a size, a product of sizes
or a multiple of one); a family with a constant that no such expression gives keeps its kernels.
Kernels whose sizes the CPU schedules would treat differently when unknown stay as they are (see
``max_elements``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

#: the largest tensor (elements) of a kernel that is shared: a kernel past it runs long enough
#: that its sizes known at compile time (vector tails, per-row operands) are worth its build
MAX_SHARED_ELEMENTS = 1 << 17
#: a shared kernel's attribute: the elements of the largest tensor of any of its members, a bound
#: its CPU schedule reads where its sizes are symbolic (a family of per-channel vectors stays serial)
LARGEST_TENSOR_ATTR = "tvmbridge.largest_tensor"


def largest_tensor(func: tirx.PrimFunc) -> int | None:
    """The bound :data:`LARGEST_TENSOR_ATTR` gives a shared kernel's tensors, else None."""
    value = func.attrs.get(LARGEST_TENSOR_ATTR) if func.attrs is not None else None
    return int(value) if value is not None else None


def _dtype(imm: tirx.IntImm) -> str:
    return imm.ty.dtype


def _constants(func: tirx.PrimFunc) -> tuple[tirx.PrimFunc, list[int]]:
    """``func`` with every integer constant zero (its family's key), and the constants in the
    order the structural walk meets them."""
    values: list[int] = []

    def zero(imm: tirx.IntImm) -> tirx.IntImm:
        values.append(int(imm.value))
        return tirx.IntImm(_dtype(imm), 0)

    return tvm_ffi.structural_map(func, [(tirx.IntImm, zero)]), values


def families(funcs: dict[tvm.ir.GlobalVar, tirx.PrimFunc]) -> list[tuple[list[tvm.ir.GlobalVar], list[list[int]]]]:
    """The kernels grouped by their code with integer constants ignored: each group's members and
    their constants (in the order the structural walk meets them)."""
    keyed: dict[int, list[tuple[tirx.PrimFunc, list[tvm.ir.GlobalVar], list[list[int]]]]] = {}
    for gv, func in funcs.items():
        key, values = _constants(func)
        bucket = keyed.setdefault(tvm_ffi.structural_hash(key), [])
        for other, members, tables in bucket:
            if tvm_ffi.structural_equal(other, key):
                members.append(gv)
                tables.append(values)
                break
        else:
            bucket.append((key, [gv], [values]))
    return [(members, tables) for bucket in keyed.values() for _, members, tables in bucket]


def index_simplified(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every index division and remainder simplified over the loops' and blocks'
    static ranges: a legalized reshape reads its input at ``flat index % size``, the identity
    where the index stays below the size (BatchNorm's ``(C,)`` statistics viewed as
    ``(1, C, 1, 1)``). Left in, that remainder would be by a size variable in a shared kernel,
    which keeps the family apart. Only those expressions change (TVM's statement simplifier would
    also bind unit loops to constants, which the CPU schedules' block analysis refuses)."""
    analyzer = tvm.sym.Analyzer()

    def bind_block(block: s_tir.SBlock) -> s_tir.SBlock:
        for iv in block.iter_vars:
            analyzer.bind(iv.var, iv.dom)
        return block

    def bind_loop(loop: tirx.For) -> tirx.For:
        analyzer.bind(loop.loop_var, tvm.ir.Range.from_min_extent(loop.min, loop.extent))
        return loop

    tvm_ffi.structural_map(func, [(s_tir.SBlock, bind_block), (tirx.For, bind_loop)])
    return tvm_ffi.structural_map(func, [((tirx.FloorDiv, tirx.FloorMod), analyzer.simplify)])


def static_largest(func: tirx.PrimFunc) -> int | None:
    """The elements of the kernel's largest tensor; None unless every parameter is a tensor of
    static shape (a symbolic kernel serves its sizes already; a scalar parameter binds no size)."""
    largest = 0
    for param in func.params:
        shape = getattr(param, "shape", None)
        if shape is None or not all(isinstance(d, tirx.IntImm) for d in shape):
            return None
        largest = max(largest, math.prod(int(d) for d in shape))
    return largest


def _scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs) and "tirx.is_scheduled" in func.attrs


def _size_vars(funcs: Sequence[tirx.PrimFunc]) -> dict[tuple[int, ...], tirx.Var]:
    """A variable per parameter size that varies across ``funcs`` (one per distinct tuple of
    values: a size two tensors share is one variable, so the kernel binds it once)."""
    sizes: dict[tuple[int, ...], tirx.Var] = {}
    for i, param in enumerate(funcs[0].params):
        for d in range(len(param.shape)):
            values = tuple(int(f.params[i].shape[d]) for f in funcs)
            if len(set(values)) > 1 and values not in sizes:
                sizes[values] = tirx.Var(f"n{len(sizes)}", "int64")
    return sizes


def _expression(values: tuple[int, ...], sizes: dict[tuple[int, ...], tirx.Var]) -> tirx.PrimExpr | None:
    """An expression of the size variables that is ``values[i]`` at member ``i``'s sizes."""
    if values in sizes:
        return sizes[values]
    items = list(sizes.items())
    for count in (2, 3):
        for combo in itertools.combinations_with_replacement(items, count):
            if all(math.prod(t[i] for t, _ in combo) == v for i, v in enumerate(values)):
                return math.prod((var for _, var in combo[1:]), start=combo[0][1])
    for known, var in items:
        if known[0] and values[0] % known[0] == 0:
            factor = values[0] // known[0]
            if all(k * factor == v for k, v in zip(known, values)):
                return var * factor
    return None


def shared_kernel(funcs: Sequence[tirx.PrimFunc], tables: Sequence[list[int]]) -> tirx.PrimFunc | None:
    """The one kernel that is each of ``funcs`` (same code but for integer constants, ``tables``
    as :func:`families` gives them) at its sizes; None where a varying constant is not an
    expression of the sizes."""
    if len({len(t) for t in tables}) != 1:
        return None
    sizes = _size_vars(funcs)
    if not sizes:
        return None
    replacements: list[tirx.PrimExpr | None] = []
    for values in zip(*tables):
        if len(set(values)) == 1:
            replacements.append(None)
            continue
        expr = _expression(values, sizes)
        if expr is None:
            return None
        replacements.append(expr)
    walk = iter(replacements)
    seen = 0

    def substitute(imm: tirx.IntImm) -> tirx.PrimExpr:
        nonlocal seen
        seen += 1
        expr = next(walk, None)
        if expr is None:
            return imm
        return expr if _dtype(imm) == "int64" else tirx.Cast(_dtype(imm), expr)

    mapped = tvm_ffi.structural_map(funcs[0], [(tirx.IntImm, substitute)])
    if seen != len(replacements):  # the walk did not meet the constants as before
        return None
    if _divides_by_size(mapped, list(sizes.values())):
        return None
    # made anew: the mapped function keeps the signature type of the one it was mapped from
    return tirx.PrimFunc(mapped.params, mapped.body, mapped.ret_type, mapped.attrs)


def _divides_by_size(func: tirx.PrimFunc, sizes: list[tirx.Var]) -> bool:
    """Whether a division or remainder in ``func`` involves a size variable (a reshape's or a
    transpose's index arithmetic): TVM's simplifier can take minutes over such indices, and each
    becomes a real integer division per element where a constant divisor was a shift."""
    found = False

    def check(node: tirx.PrimExpr) -> tirx.PrimExpr:
        nonlocal found
        if not found:
            free = tirx.analysis.undefined_vars(node)
            found = any(v.same_as(s) for v in free for s in sizes)
        return node

    tvm_ffi.structural_map(func, [((tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod), check)])
    return found


@tvm.transform.module_pass(opt_level=0, name="tvmbridge.ShareKernelsAcrossShapes")
class ShareKernelsAcrossShapes:
    """Each family of two or more kernels that differ only in their sizes (each at most
    ``max_elements`` per tensor) replaced by one kernel over symbolic sizes; the calls of the
    others call it. Kernels already scheduled are left alone."""

    def __init__(self, max_elements: int | None = None) -> None:
        self.max_elements = MAX_SHARED_ELEMENTS if max_elements is None else max_elements

    def _candidate(self, func: tirx.PrimFunc) -> bool:
        largest = static_largest(func)
        return largest is not None and largest <= self.max_elements and not _scheduled(func)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        candidates = {gv: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and self._candidate(f)}
        funcs_of = {gv: index_simplified(f) for gv, f in candidates.items()}
        plan: list[tuple[list[tvm.ir.GlobalVar], tirx.PrimFunc]] = []  # members, the kernel they share
        for members, tables in families(funcs_of):
            funcs = [funcs_of[gv] for gv in members]
            if len(members) < 2 or not all(tvm_ffi.structural_equal(f.attrs, funcs[0].attrs) for f in funcs):
                continue
            kernel = shared_kernel(funcs, tables)
            if kernel is not None:
                bound = max(static_largest(f) or 0 for f in funcs)  # every candidate's is known
                plan.append((members, kernel.with_attr(LARGEST_TENSOR_ATTR, tvm.tirx.IntImm("int64", bound))))
        if not plan:
            return mod
        replaced = {gv.name_hint for members, _ in plan for gv in members}
        kept = {gv: f for gv, f in mod.functions_items() if gv.name_hint not in replaced}
        builder = relax.BlockBuilder(tvm.IRModule(kept, attrs=mod.attrs, global_infos=mod.global_infos))
        shared_of: dict[str, tvm.ir.GlobalVar] = {}  # a member's name -> its family's kernel
        for members, kernel in plan:  # a new GlobalVar: the calls check its signature
            gv = builder.add_func(kernel, members[0].name_hint)
            shared_of.update({m.name_hint: gv for m in members})
        for gv, func in kept.items():
            if isinstance(func, relax.Function):
                remap = tvm_ffi.structural_map(func, [(tvm.ir.GlobalVar, lambda g: shared_of.get(g.name_hint, g))])
                builder.update_func(gv, remap)
        return builder.finalize()
