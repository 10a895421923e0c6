"""Gradients of nn and layout ops (``passes/gradients_nn.py``, ``passes/gradients_conv.py``) and the
converters they need (``frontend/converters/``): each op as a tiny module through ``add_tvm_dispatch`` in float64,
outputs and every gradient against PyTorch's autograd. Where TVM's own frontend or gradient is
wrong, a minimal reproduction shows what the bridge works around."""
from __future__ import annotations


import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tvmbridge import UnsupportedOpError, add_tvm_dispatch

from ..helpers import Fn, clone_module, is_tvm, run_step

F64 = torch.float64


def errors(got, want) -> dict[str, float]:
    """Max abs difference per output and gradient; a gradient PyTorch leaves undefined counts as
    zeros (``vector_norm(ord=0)`` has none)."""
    (outs_a, grads_a), (outs_b, grads_b) = got, want
    errs = {}
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        errs[f"out{i}"] = (a - b).abs().max().item() if a.numel() else 0.0
    for k in grads_a.keys() | grads_b.keys():
        a, b = grads_a.get(k), grads_b.get(k)
        a, b = (torch.zeros_like(b) if a is None else a), (torch.zeros_like(a) if b is None else b)
        errs[k] = (a - b).abs().max().item() if a.numel() else 0.0
    return errs


def check(module: nn.Module, *args: torch.Tensor, tol: float = 1e-10) -> dict[str, float]:
    """Dispatch ``module`` (a copy stays PyTorch) and compare one forward and backward, the
    variant kept by the first-call check."""
    ref = clone_module(module)
    add_tvm_dispatch(module, args)
    got, want = run_step(module, args), run_step(ref, args)
    assert is_tvm(got[0][0]), module._tvm_dispatch.explain()
    # a variant the first-call check discarded handed back PyTorch's gradients: not a pass
    assert not module._tvm_dispatch.discarded, module._tvm_dispatch.explain()
    errs = errors(got, want)
    assert max(errs.values()) <= tol, errs
    return errs


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


X3 = randn(2, 4, 7)
X4 = randn(2, 4, 5, 6)
EDGES = torch.tensor([-7.0, -6.0, -3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 6.0, 7.0], dtype=F64)


# --- clip and friends -------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [
    F.hardtanh, F.relu6, F.hardswish, F.hardsigmoid,
    lambda x: x.clamp(-0.5, 3.0), lambda x: x.clamp(min=-1.0), lambda x: x.clamp(max=0.5),
    lambda x: F.hardtanh(x, -3.0, 0.5), lambda x: F.leaky_relu(x, 0.1), lambda x: F.leaky_relu(x, -2.0),
], ids=["hardtanh", "relu6", "hardswish", "hardsigmoid", "clamp", "clamp_min", "clamp_max", "hardtanh_bounds",
        "leaky_relu", "leaky_relu_neg"])
def test_clip_family_at_and_between_the_bounds(fn):
    """On the bounds ``clamp`` passes the gradient and ``hardtanh``/``relu6``/``hardswish``/
    ``hardsigmoid`` do not: both as PyTorch (every value of EDGES sits on some bound). ATen's
    float64 ``hardsigmoid_backward`` multiplies by 1/6 rounded to float32 (5e-9 of it); the bridge's
    is the exact 1/6."""
    tol = 1e-7 if fn is F.hardsigmoid else 1e-10
    check(Fn(fn), torch.cat([EDGES, 4 * X3.reshape(-1)]), tol=tol)


def test_clamp_with_tensor_bounds_broadcast():
    lo, hi = -X3.abs()[:1], X3.abs()[:, :1] * 0.5
    check(Fn(lambda x, a, b: torch.clamp(x, a, b)), X3, lo, hi)
    check(Fn(lambda x, a: torch.clamp(x, min=a)), X3, lo)


def test_normalize():
    """``F.normalize``: the norm, ``clamp_min(eps)`` and a division; a zero row included (the
    norm's gradient there is 0 in PyTorch, NaN through a plain ``sqrt``)."""
    x = X3.clone()
    x[0, :, 0] = 0
    check(Fn(lambda x: F.normalize(x, dim=1)), x)


# --- exact kinks and ties that Relax's own gradients get wrong --------------------------------------
ZEROS = torch.tensor([-1.0, 0.0, 0.0, 2.0], dtype=F64)


@pytest.mark.parametrize("fn", [torch.relu, torch.abs, lambda x: F.elu(x)], ids=["relu", "abs", "elu"])
def test_gradient_at_zero_is_pytorchs(fn):
    """Relax's ``relu`` and ``abs`` gradients pass ``g`` at ``x == 0``; PyTorch's is 0."""
    check(Fn(fn), ZEROS)


@pytest.mark.parametrize("fn", [torch.maximum, torch.minimum, torch.max, torch.min],
                         ids=["maximum", "minimum", "max", "min"])
def test_ties_split_the_gradient(fn):
    """Equal values share the gradient in halves (Relax's own gives all of it to the first)."""
    check(Fn(fn), ZEROS, torch.tensor([[-1.0, 0.0, 1.0, 2.0]], dtype=F64).expand(2, 4).contiguous())


@pytest.mark.parametrize("fn", [
    lambda x: torch.amax(x, 1), lambda x: torch.amin(x, (0, 2), keepdim=True), lambda x: x.max(),
    lambda x: torch.logsumexp(x, 1), lambda x: torch.logsumexp(x, (0, 2)),
], ids=["amax", "amin_keepdim", "max_all", "logsumexp", "logsumexp_dims"])
def test_amax_amin_share_among_ties(fn):
    x = X3.clone()
    x[:, 1:3, :] = x[:, :1, :]  # every max over dim 1 is a three-way tie
    check(Fn(fn), x)


def test_piecewise_constant_ops_have_zero_gradient():
    check(Fn(lambda x: x * torch.floor(x) + torch.sign(x) + torch.round(x) + torch.ceil(x) + torch.trunc(x)), 3 * X3)


# --- convolutions ------------------------------------------------------------------------------------
@pytest.mark.parametrize("conv,x", [
    (nn.Conv1d(4, 6, 3), X3),
    (nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), X3),
    (nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(2, 1), dilation=(2, 1), groups=2), X4),
    (nn.ConvTranspose2d(4, 3, 3, stride=2), X4),
    (nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 3), padding=1, output_padding=(1, 2), dilation=(2, 1), groups=2), X4),
    (nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, dilation=2, groups=2), X3),
], ids=["conv1d", "conv1d_groups_dilation", "conv2d_dilation_groups", "conv_transpose2d",
        "conv_transpose2d_all", "conv_transpose1d"])
def test_convolutions(conv, x):
    torch.manual_seed(0)
    check(conv.double(), x)


@pytest.mark.parametrize("shape,kwargs", [
    ((2, 3, 9, 9), dict(kernel_size=3, stride=2, padding=1)),
    ((2, 2, 16, 16), dict(kernel_size=3, stride=2, padding=1)),  # even size: the gather form gave NaN
    ((2, 2, 3, 3), dict(kernel_size=3, stride=2)),
    ((2, 2, 1, 5), dict(kernel_size=(1, 3), stride=(1, 2))),
    ((2, 2, 7, 7), dict(kernel_size=3, stride=2, dilation=2)),
    ((2, 2, 6, 7), dict(kernel_size=(2, 3), stride=(3, 2), padding=1, ceil_mode=True)),
    ((1, 4, 1, 9), dict(kernel_size=(1, 3), stride=(1, 3), padding=(0, 1))),
    ((1, 3, 9, 9), dict(kernel_size=3, stride=3, padding=1)),
    ((2, 1, 1, 36), dict(kernel_size=(1, 3), stride=1, padding=(0, 1))),
], ids=["resnet_stem", "resnet_stem_even", "one_window", "row_stride", "dilation", "ceil_mode", "pad_stride_3_row",
        "pad_stride_3", "pad_stride_1"])
def test_max_pool2d(shape, kwargs):
    """Relax's own ``max_pool2d_backward`` is wrong for some strides (errors of order 1 for a
    single 3x3 window of stride 2, NaN for a (1, 3) window of stride (1, 2); with padding, garbage
    for a 3-window of stride 3 or 1) and does not build with dilation; the bridge's sends the
    gradient to each window's first max, as ATen, in every case (its padded form once gave NaN on
    even sizes: TVM's flattening, ``backend/flatten_hazard.py``). Rounded inputs: ties."""
    x = randn(*shape).round()
    check(Fn(lambda x: F.max_pool2d(x, **kwargs)), x)
    check(Fn(lambda x: F.max_pool1d(x, 3, 2, ceil_mode=True)), X3)


@pytest.mark.parametrize("shape,kwargs", [
    ((1, 1, 18, 19), dict(kernel_size=5, stride=2, padding=1, ceil_mode=True)),
    ((2, 1, 19, 8), dict(kernel_size=5, stride=3, padding=2, ceil_mode=True)),
    ((2, 3, 7, 7), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    ((2, 3, 7, 7), dict(kernel_size=3, stride=2, padding=1)),
    ((1, 2, 5, 6), dict(kernel_size=(3, 2), stride=1, padding=(1, 0), count_include_pad=False)),
], ids=["ceil_overhang", "ceil_overhang_stride_3", "ceil_excluding_pad", "padded", "rect_excluding_pad"])
def test_avg_pool2d(shape, kwargs):
    """Relax's own ``avg_pool2d`` gradient is wrong where a ceil_mode window overhangs the padding
    and the padding counts (errors of 0.03-0.1); the bridge's divides by ATen's divisors and adds
    in ATen's order."""
    check(Fn(lambda x: F.avg_pool2d(x, **kwargs)), randn(*shape))


def test_avg_pool2d_over_a_symbolic_batch():
    m = Fn(lambda x: F.avg_pool2d(x, 3, 2, 1))
    ref = clone_module(m)
    add_tvm_dispatch(m, (randn(2, 3, 7, 7),))
    for batch in (2, 3, 5):
        x = randn(batch, 3, 7, 7, seed=batch)
        errs = errors(run_step(m, (x,)), run_step(ref, (x,)))
        assert max(errs.values()) <= 1e-12, (batch, errs)
    assert not m._tvm_dispatch.discarded and len(m._tvm_dispatch.variants) <= 2, m._tvm_dispatch.explain()


def test_tvm_conv2d_gradient_fails_with_dilation():
    """Minimal reproduction: Relax's own ``conv2d`` gradient leaves the dilation out of the
    output padding it gives ``conv2d_transpose``, so a dilated convolution could not be
    differentiated. The bridge's gradient (above, ``conv2d_dilation_groups``) computes it."""
    from tvm import relax
    from tvm.relax.op import _op_gradient

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, 7, 7), "float32"))
    w = relax.Var("w", relax.TensorType((3, 2, 3, 3), "float32"))
    with bb.function("f", [x, w]):
        call = relax.op.nn.conv2d(x, w, dilation=2)
        y = bb.emit(call)
        with pytest.raises(ValueError, match="output padding less than the strides"):
            bb.normalize(_op_gradient.conv2d_grad(y, call, bb.emit(relax.op.ones_like(y)), bb)[0])
        bb.emit_func_output(y)


# --- normalization and pooling -----------------------------------------------------------------------
@pytest.mark.parametrize("norm,x", [
    (nn.GroupNorm(2, 4), X4), (nn.GroupNorm(4, 4, affine=False), X3), (nn.GroupNorm(1, 4, eps=1e-3), X3 * 5 + 2),
], ids=["groups2_2d", "instance_like_1d", "one_group"])
def test_group_norm(norm, x):
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
    check(norm.double(), x)


def test_group_norm_float32_uses_the_bridges_gradient():
    errs = check(nn.GroupNorm(2, 4), X4.float(), tol=1e-5)
    assert errs["weight"] <= 1e-5


@pytest.mark.parametrize("groups", [1, 4])
def test_group_norm_float32_of_a_large_mean_is_as_accurate_as_atens(groups):
    """A group whose mean is large against its spread (PoolFormer's one-group norms after a
    residual): the variance as ``E[x^2] - E[x]^2`` in float32 (TOPI's ``group_norm``) cancels to
    outputs off by 0.5; two-pass statistics, as ATen's, keep them within eager's own error."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(groups, 8)
    tvm = clone_module(norm)
    add_tvm_dispatch(tvm, verify=False)
    x = torch.randn(2, 8, 4, 4) * 0.05 + 30.0
    want = clone_module(norm).double()(x.double())
    eager_err = (norm(x).double() - want).abs().max().item()
    got = tvm(x)
    assert is_tvm(got)
    assert (got.double() - want).abs().max().item() <= 4 * eager_err + 1e-6


@pytest.mark.parametrize("fn", [lambda x: x.var(), lambda x: x.std(-1), lambda x: torch.var_mean(x, (0, 2))[0]],
                         ids=["var", "std", "var_mean"])
def test_float32_variance_of_a_large_mean_is_as_accurate_as_atens(fn):
    """ATen accumulates a float32 ``var`` in double; in float32 the mean's rounding reaches every
    deviation of values near 1000 spread by 0.01 (outputs 1e-4 off, gradients 3%)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64) * 0.01 + 1000.0
    eager, tvm = Fn(fn), Fn(fn)
    add_tvm_dispatch(tvm, verify=False)
    xr, xe, xt = x.double().requires_grad_(), x.clone().requires_grad_(), x.clone().requires_grad_()
    want, ye, yt = fn(xr), eager(xe), tvm(xt)
    assert is_tvm(yt)
    for y, xx in ((want, xr), (ye, xe), (yt, xt)):
        y.sum().backward()
    scale_y, scale_dx = want.abs().max().item(), xr.grad.abs().max().item()
    assert (yt.double() - want).abs().max().item() <= 4 * (ye.double() - want).abs().max().item() + 1e-6 * scale_y
    assert (xt.grad.double() - xr.grad).abs().max().item() <= 4 * (xe.grad.double() - xr.grad).abs().max().item() + 1e-6 * scale_dx


@pytest.mark.parametrize("fn,x", [
    (lambda x: F.adaptive_avg_pool2d(x, (3, 4)), X4), (lambda x: F.adaptive_avg_pool2d(x, 1), X4),
    (lambda x: F.adaptive_avg_pool1d(x, 3), X3), (lambda x: F.interpolate(x, scale_factor=0.5, mode="area"), X4),
], ids=["overlapping_bins", "global", "1d", "interpolate_area"])
def test_adaptive_avg_pool(fn, x):
    check(Fn(fn), x)


# --- interpolation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(scale_factor=2, mode="nearest"), dict(size=(7, 4), mode="nearest"),
    dict(scale_factor=(1.7, 0.6), mode="nearest"), dict(size=(7, 9), mode="bilinear"),
    dict(size=(3, 11), mode="bilinear", align_corners=True), dict(scale_factor=(1.7, 0.6), mode="bilinear"),
    dict(scale_factor=1.5, mode="nearest-exact"), dict(scale_factor=1.5, mode="bicubic"),
], ids=["nearest_x2", "nearest_size", "nearest_scale", "bilinear", "bilinear_aligned", "bilinear_scale",
        "nearest_exact", "bicubic"])
def test_interpolate(kwargs):
    """As ATen computes it, scale factors included (PyTorch reads ``1/scale_factor``, not
    ``in/out``): gathers at ATen's indices, weighted for bilinear."""
    check(Fn(lambda x: F.interpolate(x, **kwargs)), X4)


def test_interpolate_float32_forward_is_atens():
    x = X4.float()
    m = Fn(lambda x: F.interpolate(x, scale_factor=(1.7, 0.6), mode="bilinear"))
    want = m(x)
    add_tvm_dispatch(m, (x,))
    assert torch.allclose(m(x), want, rtol=0, atol=1e-6)


AA_SIZES = [dict(size=(3, 2)), dict(size=(11, 13)), dict(scale_factor=0.4), dict(size=(2, 9), align_corners=True),
            dict(scale_factor=(1.7, 0.6)), dict(size=(5, 3))]


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("kwargs", AA_SIZES, ids=["down", "up", "scale", "aligned", "up_down", "one_axis"])
def test_antialiased_interpolation(mode, kwargs):
    """``antialias=True`` (TVM's frontend would compute plain bilinear: a different picture when
    downsampling): ATen's filter weights per axis, as matmuls."""
    check(Fn(lambda x: F.interpolate(x, mode=mode, antialias=True, **kwargs)), X4)


def test_antialiased_interpolation_float32_forward():
    """float32 as ATen's within rounding (ATen's CPU kernel has no bfloat16 to compare with)."""
    dtype = torch.float32
    x = X4.to(dtype).requires_grad_()
    m = Fn(lambda x: F.interpolate(x, size=(3, 11), mode="bicubic", antialias=True))
    want = m(x)
    add_tvm_dispatch(m, (x,))
    got = m(x)
    assert is_tvm(got) and got.dtype == dtype
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_tvm_frontend_nearest_interpolation_differs_from_pytorch():
    """Minimal reproduction: TVM's own conversion of ``upsample_nearest2d`` (``resize2d`` with
    half-pixel rounding, ``in/out`` scale) reads other source pixels than PyTorch."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    x = torch.arange(30.0).reshape(1, 1, 5, 6)
    m = Fn(lambda x: F.interpolate(x, scale_factor=(1.7, 0.6), mode="nearest"))
    mod = from_exported_program(torch.export.export(m, (x,)).run_decompositions())
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x.numpy()))
    out = out[0] if isinstance(out, (list, tuple)) or hasattr(out, "__getitem__") and not hasattr(out, "numpy") else out
    assert not torch.equal(torch.from_numpy(out.numpy()), m(x))


# --- layout ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn,args", [
    (lambda x: F.pad(x, (1, 2, 0, 1)), (X4,)),
    (lambda x: F.pad(x, (1, 2, 0, 1, 2, 0), value=1.5), (X4,)),
    (lambda x: F.pad(x, (-1, 2, 1, -2)), (X4,)),
    (lambda x: x.flip(1, 2), (X3,)),
    (lambda x: x.repeat(2, 1, 3), (X3,)),
    (lambda x: x.repeat(3, 2, 1, 1), (X3,)),
    (lambda x: torch.tile(x, (2,)), (X3,)),
    (lambda x, y: torch.stack([x, y, x], 1), (X3, 2 * X3)),
    (lambda x: torch.stack([x[0, 0, 0], x[1, 1, 1]]), (X3,)),
    (lambda x: torch.split(x, [1, 3], dim=1), (X3,)),
    (lambda x: torch.split(x, [4, 1, 2], dim=-1)[1] * 2, (X3,)),
    (lambda x: torch.split(x, 4, dim=1)[0] * 2, (X3,)),
], ids=["pad", "pad_value_3d", "pad_negative", "flip", "repeat", "repeat_new_dims", "tile", "stack",
        "stack_scalars", "split_sizes", "split_sizes_one_used", "split_whole_axis"])
def test_layout_ops(fn, args):
    check(Fn(fn), *args)


# --- indexing ------------------------------------------------------------------------------------
def test_negative_indices_read_from_the_end():
    """``x[idx]`` and ``torch.take`` with negative indices: the frontend read them out of bounds
    (values like 1e179); an index out of range raises like PyTorch."""
    idx = torch.tensor([-1, 0, -4, 2])
    check(Fn(lambda x, i: x[i] * 2), X3[0], idx)
    check(Fn(lambda x, i: x[:, i]), X3[0], idx)
    check(Fn(lambda x, i: torch.take(x, i)), X3, torch.tensor([-56, 3, -1]))
    m = Fn(lambda x, i: x[i])
    add_tvm_dispatch(m, (X3[0], idx))
    with pytest.raises(IndexError):
        m(X3[0], torch.tensor([0, -5]))


I4, J4 = torch.tensor([0, 2, 3, 1]), torch.tensor([1, 1, 4, 0])


@pytest.mark.parametrize("fn", [
    lambda x, i, j: x[:, :, i, j],  # zipped: one element per pair
    lambda x, i, j: x[:, :, i[:, None], j[None, :]],  # an outer product by broadcasting
    lambda x, i, j: x[:, :, i[None, :], j[:, None]],  # the same, transposed
    lambda x, i, j: x[:, :, i.view(2, 2), j.view(2, 2)],
    lambda x, i, j: x[:, i % 4, :, j],  # apart: the indexed dims go in front
    lambda x, i, j: x[i % 2, j % 4],  # leading axes
    lambda x, i, j: x[:, :, -i - 1, j - 6],  # from the end
    lambda x, i, j: x.sum(1)[torch.arange(2), (x[:, 0, :, 0] > 0).sum(-1) - 1],  # a classifier's last token
], ids=["zip", "outer", "outer_transposed", "zip_2d", "apart", "leading", "negative", "last_token"])
def test_several_index_tensors_read_as_pytorch_reads(fn):
    """``x[..., i, j]`` with two index tensors broadcast together: the frontend took an outer
    product of some (a transposed result, which the first-call check then sent to PyTorch), could
    not convert others and had no gradient for the rest."""
    check(Fn(fn), X4, I4, J4)


def test_several_index_tensors_out_of_range_raise_like_pytorch():
    m = Fn(lambda x, i, j: x[:, :, i, j])
    add_tvm_dispatch(m, (X4, I4, J4))
    with pytest.raises(IndexError):
        m(X4, I4, torch.tensor([1, 6, 0, 0]))


def test_unconverted_outputs_of_multi_output_ops_are_refused():
    """``native_layer_norm``'s mean and rstd: the frontend converts the op to its first output
    and its ``getitem`` then returns that for every index (a silently wrong value)."""
    m = Fn(lambda x: torch.ops.aten.native_layer_norm.default(x, [7], None, None, 1e-5)[1])
    with pytest.raises(UnsupportedOpError, match="output 1 of native_layer_norm"):
        add_tvm_dispatch(m, (X3,))


def test_integer_clamp_with_one_bound_builds():
    """``clamp(int_tensor, max=5)``: the frontend's other bound is ``inf``, which an integer
    kernel cannot hold (the build failed); linear interpolation decomposes to it."""
    check(Fn(lambda x, i: x * i.clamp(max=5) + x[..., :1] * i.clamp(min=2)), X3, torch.arange(7))
    check(Fn(lambda x: F.interpolate(x, scale_factor=1.7, mode="linear")), X3)


# --- 0-d tensors and vector norms ----------------------------------------------------------------
SCALAR = torch.tensor(1.5, dtype=F64)


@pytest.mark.parametrize("fn,args", [
    (lambda x: x.sum(0), (SCALAR,)), (lambda x: x.sum(-1, keepdim=True), (SCALAR,)),
    (lambda x: x.mean(0), (SCALAR,)), (lambda x: torch.amax(x, 0), (SCALAR,)),
    (lambda x, i: x.index_select(0, i) * 3, (SCALAR, torch.tensor([0]))),
    (lambda x, i: x.index_select(0, i) * 3, (SCALAR, torch.tensor(0))),
], ids=["sum", "sum_keepdim", "mean", "amax", "index_select_1d_index", "index_select_0d_index"])
def test_zero_dim_reductions(fn, args):
    check(Fn(fn), *args)


def test_zero_dim_constant_in_the_graph():
    """A 0-d tensor constant (``torch.tensor(3.0)`` in forward) crashed the compile cache's
    fingerprint (a 0-d tensor cannot be viewed as bytes)."""
    check(Fn(lambda x: x * torch.tensor(3.0, dtype=F64)), X3)


@pytest.mark.parametrize("ord_,dim", [(0, None), (0, 1), (2, 1), (2, None), (1, (1, 2)), (3, 2), (0.5, 1),
                                       (float("inf"), 2), (float("-inf"), None), (-1, 1)])
def test_vector_norm(ord_, dim):
    """``ord=0`` counts nonzeros (the frontend divides by zero) with gradient 0; the others get
    PyTorch's gradient also where entries (or whole vectors) are 0."""
    x = X3.clone()
    if ord_ > 0:
        x[0, 1] = 0
        x[1, :, 3] = 0
    check(Fn(lambda x: torch.linalg.vector_norm(x, ord_, dim)), x)


def test_a_parameter_seen_only_by_a_count_of_nonzeros_keeps_grad_none():
    """PyTorch's ``vector_norm(ord=0)`` backward is undefined: a parameter reached only through
    it keeps ``.grad`` None (an optimizer then skips it: no weight decay, no moments), as an
    input used elsewhere still gets its gradient."""

    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.counted = nn.Parameter(randn(4)), nn.Parameter(randn(4, seed=1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.w).sum() + torch.linalg.vector_norm(self.counted, 0) + torch.linalg.vector_norm(x, 0)

    module, x = Counted(), randn(3, 4).requires_grad_()
    ref = clone_module(module)
    add_tvm_dispatch(module, (x,), verify=False)
    module(x).backward()
    ref(x.detach().clone().requires_grad_()).backward()
    assert module._tvm_dispatch.calls_tvm == 1
    assert module.counted.grad is None and ref.counted.grad is None
    assert module.w.grad is not None and torch.allclose(module.w.grad, ref.w.grad)


# --- where and safe softmax ------------------------------------------------------------------------
def test_where_gradient_sums_a_broadcast_branch():
    """Minimal reproduction: Relax's own ``where`` gradient returns each branch's gradient at the
    output's shape, so a broadcast branch (here (2, 1, 4) into (2, 3, 4), as in ``diag_embed``
    or a masked fill) got a silently wrong gradient (errors of order 1 before the fix)."""
    mask = torch.rand(3, 1) > 0.5
    check(Fn(lambda x, y, m: torch.where(m, x[:, None, :], y)), randn(2, 4), randn(3, 4, seed=1), mask)
    check(Fn(torch.diag_embed), randn(3, 4))


def test_safe_softmax_of_fully_masked_rows():
    """``_safe_softmax`` (attention's: 0 on rows that mask everything) had NaN gradients there:
    the decomposition now feeds those rows 0 before the softmax."""
    x = randn(2, 3, 4)
    x[0, 1] = float("-inf")
    x[1, :, 2] = float("-inf")
    check(Fn(lambda x: torch.ops.aten._safe_softmax.default(x, -1)), x)


@pytest.mark.parametrize("fn,x", [
    (torch.asin, X3.tanh()), (torch.acos, X3.tanh()), (torch.atan, X3), (torch.tan, X3.tanh()),
    (torch.asinh, X3), (torch.acosh, X3.abs() + 1.5), (torch.atanh, X3.tanh() * 0.9),
    (lambda x: torch.atan2(x, x[:1].abs() + 0.5), X3), (lambda x: torch.remainder(x, x[:1] + 5), X3),
    (lambda x: torch.fmod(x * 3, x[:1].abs() + 0.5), X3),
], ids=["asin", "acos", "atan", "tan", "asinh", "acosh", "atanh", "atan2", "remainder", "fmod"])
def test_elementwise_gradients_relax_lacks(fn, x):
    check(Fn(fn), x)


def test_a_case_no_formula_covers_is_refused_naming_the_op():
    """Reflect padding (the bridge's converters never make it: PyTorch's decomposes to gathers)
    has no exact gradient here: an ``UnsupportedOpError`` that names ``relax.nn.pad``."""
    from tvm import relax

    from tvmbridge.passes.gradient import build_adjoint

    x = relax.Var("x", relax.TensorType((2, 5), "float64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.pad(x, [0, 0, 1, 1], "reflect")))
        bb.emit_func_output(out)
    with pytest.raises(UnsupportedOpError, match="reflect") as err:
        build_adjoint(bb.get()["main"], [0], [True])
    assert err.value.op == "relax.nn.pad"


@pytest.mark.parametrize("fn", [
    lambda x: torch.topk(x, 3, dim=-1)[0],
    lambda x: torch.topk(x.softmax(-1), 2, dim=1, largest=False)[0],
    lambda x: torch.topk(x, 2, dim=0)[0] * torch.topk(x, 2, dim=0)[1].to(x.dtype),
    # DeepSeek-V3's router: order unspecified, so used order-free (a sum, or k=1)
    lambda x: torch.topk(x, 3, dim=-1, sorted=False)[0].sum(-1, keepdim=True) * torch.topk(x, 1, dim=0, sorted=False)[0],
], ids=["values", "smallest", "indices_used", "unsorted"])
def test_topk_gradient_goes_back_where_the_values_were_read(fn):
    """A mixture-of-experts router's top-k weights (Relax has no topk gradient)."""
    check(Fn(fn), X3)


# --- recurrent layers ----------------------------------------------------------------------------
class Recurrent(nn.Module):
    """The layer's output, or its final states (``_, (h, c) = lstm(x)``), or all three."""

    def __init__(self, layer: nn.Module, returns: str = "output") -> None:
        super().__init__()
        self.layer, self.returns = layer.double(), returns

    def forward(self, x: torch.Tensor):
        out = self.layer(x)
        if not isinstance(out, tuple):
            return out
        states = out[1] if isinstance(out[1], tuple) else (out[1],)
        return {"output": out[0], "states": states, "all": (out[0], *states)}[self.returns]


@pytest.mark.parametrize("make,returns", [
    (lambda: nn.LSTM(7, 5, batch_first=True), "output"),
    (lambda: nn.LSTM(7, 5, batch_first=True, bidirectional=True), "all"),
    (lambda: nn.LSTM(7, 5), "states"),
    (lambda: nn.LSTM(7, 5, num_layers=3, bidirectional=True, batch_first=True), "all"),
    (lambda: nn.LSTM(7, 5, num_layers=2, bias=False), "states"),
    (lambda: nn.GRU(7, 5, batch_first=True), "output"),
    (lambda: nn.GRU(7, 5, num_layers=3, bidirectional=True), "all"),
    (lambda: nn.GRU(7, 5, num_layers=2, bias=False, batch_first=True), "states"),
    (lambda: nn.RNN(7, 5, num_layers=2, batch_first=True), "all"),
    (lambda: nn.RNN(7, 5, nonlinearity="relu", bidirectional=True), "states"),
], ids=["lstm", "lstm_bidirectional", "lstm_states", "lstm_3_layers", "lstm_2_layers_no_bias", "gru",
        "gru_3_layers_bidirectional", "gru_2_layers_no_bias", "rnn_2_layers", "rnn_relu_bidirectional"])
def test_recurrent_layers_train(make, returns):
    """The frontend stacks the steps' outputs (``relax.stack``, which had no gradient: an LSTM
    was refused; timm's Sequencer too), and its recurrent converters took one layer and gave no
    final states (``_, (h, c) = lstm(x)``, ``_, h = gru(x)`` and stacked layers were refused)."""
    torch.manual_seed(0)
    check(Recurrent(make(), returns), randn(2, 5, 7))


def test_lstm_with_initial_states_and_what_is_refused():
    torch.manual_seed(0)
    lstm = nn.LSTM(7, 5, num_layers=2, batch_first=True).double()
    check(Fn(lambda x, h, c: lstm(x, (h, c))[1][0]), randn(2, 5, 7), randn(2, 2, 5, seed=1), randn(2, 2, 5, seed=2))
    gru = nn.GRU(7, 5, num_layers=2, bidirectional=True).double()
    check(Fn(lambda x, h: gru(x, h)[0]), randn(5, 2, 7), randn(4, 2, 5, seed=1))
    with pytest.raises(UnsupportedOpError, match="proj_size"):
        add_tvm_dispatch(Recurrent(nn.LSTM(7, 5, proj_size=3)), (randn(5, 2, 7),))


@pytest.mark.parametrize("make", [
    lambda: nn.LSTM(7, 5, num_layers=2, dropout=0.5, batch_first=True),
    lambda: nn.GRU(7, 5, num_layers=3, dropout=0.3, bidirectional=True),
    lambda: nn.RNN(7, 5, num_layers=2, dropout=0.4, nonlinearity="relu", batch_first=True),
], ids=["lstm-batch-first", "gru-bidirectional-3", "rnn-relu"])
def test_stacked_rnns_draw_eagers_dropout_masks_between_layers(make):
    """Dropout between an RNN's layers in training: the masks ATen's fused op draws inside, drawn
    per call in the same order from the same generator, so two calls give eager's outputs and
    gradients under eager's seed; eval draws none."""
    torch.manual_seed(0)
    m = Recurrent(make(), "output").float()
    ref = copy.deepcopy(m)
    x = torch.randn(2, 6, 7) if make().batch_first else torch.randn(6, 2, 7)
    add_tvm_dispatch(m, (x,))
    for seed in (1, 2):
        got, want = [], []
        for net, out in ((m, got), (ref, want)):
            torch.manual_seed(seed)
            xi = x.clone().requires_grad_()
            y = net(xi)
            y.square().sum().backward()
            out += [y, xi.grad, *(p.grad for p in net.parameters())]
            net.zero_grad()
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert len(m._tvm_dispatch.variants) == 1
    m.eval(), ref.eval()
    torch.testing.assert_close(m(x), ref(x), rtol=1e-4, atol=1e-5)
