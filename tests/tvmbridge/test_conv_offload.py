"""Convolutions on PyTorch's kernels (``backend/conv_offload.py``, ``kernels/conv.py``): every
convolution of a training step (forward, and those its input and weight gradients are written
with) runs in the library, with PyTorch's outputs and gradients, for strides, padding, dilation,
groups, transposed convolutions, a symbolic batch and bfloat16 autocast; ``offload_matmul=False``
keeps TVM's own kernels."""

from __future__ import annotations

import pytest
import torch
import tvm_ffi
from tvm import relax

from tests.helpers import clone_module, is_tvm, max_errors, run_step
from tvmbridge import add_tvm_dispatch
from tvmbridge.backend.conv_offload import offloaded_convs
from tvmbridge.kernels import conv as conv_kernels
from tvmbridge.runtime.dispatch import dispatcher_of


class ConvNet(torch.nn.Module):
    """A 7x7 stride-2 stem (stride not dividing the padded size), a dilated grouped conv, a
    transposed conv, a 1x1 conv, BatchNorm, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 7, stride=2, padding=3)
        self.norm = torch.nn.BatchNorm2d(8)
        self.dilated = torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.down = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.up = torch.nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1)
        self.point = torch.nn.Conv2d(8, 4, 1)
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.stem(x)))
        x = torch.relu(self.dilated(x)) + x
        x = torch.relu(self.up(torch.relu(self.down(x))))
        return self.head(self.point(x).mean((2, 3)))


def _conv_ops(mod) -> int:
    """Relax convolutions left in TVM, over all functions."""
    return sum(
        1
        for gv, func in mod.functions.items()
        if isinstance(func, relax.Function)
        for block in func.body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call) and "conv" in getattr(b.value.op, "name", "")
    )


def _dispatched(model, x, **options):
    module = add_tvm_dispatch(clone_module(model), (x,), **options)
    return module, dispatcher_of(module).variants[0].compiled


class Separable(torch.nn.Module):
    """Depthwise-separable blocks as MobileNet/EfficientNet/ConvNeXt write them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.dw5 = torch.nn.Conv2d(8, 8, 5, stride=2, padding=2, groups=8, bias=False)
        self.dw7 = torch.nn.Conv2d(8, 8, 7, padding=3, groups=8)
        self.grouped = torch.nn.Conv2d(8, 16, 3, padding=1, groups=4)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = torch.relu(self.dw(x)) + x
        x = self.dw7(torch.relu(self.dw5(x)))
        return self.head(self.grouped(x).mean((2, 3)))


def _calls(func: relax.Function, name: str) -> int:
    """How many bindings of ``func`` call the packed function ``name``."""
    return sum(
        1
        for block in func.body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call)
        and b.value.op.name == "relax.call_pure_packed"
        and str(b.value.args[0].global_symbol) == name
    )


@pytest.mark.parametrize(
    "make, shape, forward, backward, pairs",
    [
        # backward: the stem's, down's and point's two gradients as one call each; the dilated
        # grouped convolution's weight gradient is a plain grouped convolution (not paired), the
        # transposed convolution's gradients a convolution and a weight gradient
        (ConvNet, (3, 3, 33, 33), 5, 7, 3),
        (Separable, (2, 3, 21, 21), 5, 5, 5),  # depthwise and grouped: every one paired
    ],
    ids=["convnet", "separable"],
)
def test_every_convolution_of_a_training_step_runs_in_the_library(make, shape, forward, backward, pairs):
    torch.manual_seed(0)
    model, x = make(), torch.randn(*shape)
    module, compiled = _dispatched(model, x)
    halves = compiled.stages["fast_math"]
    assert _conv_ops(halves) == 0, halves["backward"].script()
    assert offloaded_convs(halves["forward"]) == forward
    assert offloaded_convs(halves["backward"]) == backward
    assert _calls(halves["backward"], conv_kernels.CONV2D_BACKWARD) == pairs
    errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < 2e-5, errs


def test_tvm_kernels_where_offload_is_off():
    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(2, 3, 17, 17)
    module, compiled = _dispatched(model, x, offload_matmul=False)
    halves = compiled.stages["fast_math"]
    assert offloaded_convs(halves["forward"]) == 0 and _conv_ops(halves) > 0
    errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < 2e-5, errs


def test_a_symbolic_batch_runs_on_the_library():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(6, 2, 3))
    module = add_tvm_dispatch(clone_module(model), (torch.randn(2, 3, 12, 12),), dynamic={"input": {0: "batch"}})
    compiled = dispatcher_of(module).variants[0].compiled
    assert compiled.traced.symbolic and offloaded_convs(compiled.stages["fast_math"]["forward"]) == 2
    assert _calls(compiled.stages["fast_math"]["backward"], conv_kernels.CONV2D_BACKWARD) == 2
    for n in (2, 5):
        x = torch.randn(n, 3, 12, 12)
        got = run_step(module, (x,))
        assert is_tvm(got[0][0])
        errs = max_errors(got, run_step(clone_module(model), (x,)))
        assert max(errs.values()) < 2e-5, errs


def _eager_at_every_batch_in_one_symbolic_variant(model: torch.nn.Module, shapes: list[tuple]) -> None:
    """A training step at each shape equals eager's; the second compiled one symbolic variant
    that served the rest."""
    module = add_tvm_dispatch(clone_module(model), verify=False)
    for shape in shapes:
        x = torch.randn(*shape)
        got = run_step(module, (x,))
        assert is_tvm(got[0][0])
        errs = max_errors(got, run_step(clone_module(model), (x,)))
        assert max(errs.values()) < 2e-5, errs
    variants = dispatcher_of(module).variants
    assert len(variants) == 2 and variants[1].symbolic, dispatcher_of(module).explain()


class Sequence1d(torch.nn.Module):
    """Mamba's and Whisper's 1-D convolutions (a causal depthwise one, a strided one, a dilated
    grouped one) and a dilated 2-D one: the bridge's own gradient formulas, not Relax's."""

    def __init__(self) -> None:
        super().__init__()
        self.depthwise = torch.nn.Conv1d(6, 6, 4, padding=3, groups=6)
        self.strided = torch.nn.Conv1d(6, 8, 3, stride=2, padding=1)
        self.dilated = torch.nn.Conv1d(8, 8, 3, padding=2, dilation=2, groups=2)
        self.plane = torch.nn.Conv2d(1, 2, 3, padding=2, dilation=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.depthwise(x)[..., : x.shape[-1]])
        h = self.dilated(torch.relu(self.strided(h)))
        return self.plane(h.unsqueeze(1)).mean((1, 2))


def test_one_dimensional_and_dilated_gradients_over_a_symbolic_batch():
    torch.manual_seed(0)
    _eager_at_every_batch_in_one_symbolic_variant(Sequence1d(), [(n, 6, 12) for n in (2, 3, 5)])


class CausalConvs(torch.nn.Module):
    """Mamba's causal depthwise convolution and ConvBERT's grouped, dilated span convolution over
    a sequence of any length; ``stride`` on the last one."""

    def __init__(self, stride: int) -> None:
        super().__init__()
        self.depthwise = torch.nn.Conv1d(6, 6, 4, padding=3, groups=6)
        self.dilated = torch.nn.Conv1d(6, 8, 3, padding=2, dilation=2, groups=2)
        self.point = torch.nn.Conv1d(8, 4, 1, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.depthwise(x)[..., : x.shape[-1]])
        return self.point(torch.relu(self.dilated(h))).pow(2).mean(-1)


@pytest.mark.parametrize("stride", [1, 2])
def test_one_dimensional_gradients_over_a_symbolic_length(stride):
    """Stride 1: one variant over batch and length. A stride of 2 over a symbolic length has an
    output padding that is the length modulo 2: refused there, so each length compiles exactly
    (right numbers either way)."""
    torch.manual_seed(0)
    model = CausalConvs(stride)
    module = add_tvm_dispatch(clone_module(model), verify=False)
    for n, length in ((2, 12), (3, 12), (3, 17), (2, 9)):
        x = torch.randn(n, 6, length)
        got = run_step(module, (x,))
        assert is_tvm(got[0][0])
        errs = max_errors(got, run_step(clone_module(model), (x,)))
        assert max(errs.values()) < 2e-5, errs
    symbolic = [v.symbolic for v in dispatcher_of(module).variants]
    assert symbolic == ([False, True, True] if stride == 1 else [False, True, False, False]), symbolic


class Resize(torch.nn.Module):
    """CoaT's and FPNs' resizing between convolutions: bilinear (both corner modes), nearest and
    antialiased interpolation of a batch of any size."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        h = self.conv(x)
        up = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        corners = F.interpolate(h, size=(9, 11), mode="bilinear", align_corners=True)
        near = F.interpolate(h, size=(5, 7), mode="nearest")
        small = F.interpolate(h, size=(3, 4), mode="bilinear", antialias=True)
        return up.pow(2).mean((2, 3)) + corners.mean((2, 3)) + near.sin().mean((2, 3)) + small.mean((2, 3))


def test_interpolation_over_a_symbolic_batch():
    torch.manual_seed(0)
    _eager_at_every_batch_in_one_symbolic_variant(Resize(), [(n, 3, 8, 10) for n in (2, 3, 5)])


class PoolAndTile(torch.nn.Module):
    """VGG's adaptive pooling to a grid larger than 1x1 (1-D too) and a tiled activation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        grid = torch.nn.functional.adaptive_avg_pool2d(h, (3, 2))
        line = torch.nn.functional.adaptive_avg_pool1d(h.flatten(2), 5)
        tiled = grid.flatten(1).repeat(1, 2).unsqueeze(1).repeat(1, 3, 2)
        return tiled.pow(2).mean((1, 2)) + line.sin().mean((1, 2))


def test_adaptive_pooling_and_tiling_over_a_symbolic_batch():
    torch.manual_seed(0)
    _eager_at_every_batch_in_one_symbolic_variant(PoolAndTile(), [(n, 3, 7, 9) for n in (2, 3, 5)])


def test_bfloat16_autocast_matches_eager_autocast():
    torch.manual_seed(0)
    model, x = ConvNet(), torch.randn(2, 3, 17, 17)
    module = add_tvm_dispatch(clone_module(model), (x,))
    ref = clone_module(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = module(x)
        want = ref(x)
    assert is_tvm(got) and got.dtype == want.dtype == torch.bfloat16
    assert offloaded_convs(dispatcher_of(module).variants[-1].compiled.stages["fast_math"]["forward"]) == 5
    torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("layouts", [(0, 0, 0), (1, 1, 1)])
def test_the_packed_convolution_reads_every_layout_and_asymmetric_padding(layouts):
    """Padding (top, left, bottom, right) unequal, which PyTorch's convolution takes only as a
    pad first, and the swapped layouts a weight gradient uses."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 9, 8, generator=g), torch.randn(4, 3, 3, 2, generator=g)
    data_cn, kernel_io, out_cn = layouts
    xs = x.permute(1, 0, 2, 3).contiguous() if data_cn else x
    ws = w.permute(1, 0, 2, 3).contiguous() if kernel_io else w
    attrs = tvm_ffi.Shape((2, 1, 1, 0, 2, 1, 1, 2, 1, *layouts, 0))
    got = torch.from_dlpack(conv_kernels.conv2d(tvm_ffi.from_dlpack(xs), tvm_ffi.from_dlpack(ws), attrs))
    want = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (0, 1, 1, 2)), w, None, (2, 1), 0, (1, 2))
    torch.testing.assert_close(got, want.permute(1, 0, 2, 3) if out_cn else want)


def test_float64_runs_the_same_calls():
    """The double-precision checks exercise the library calls float32 training runs."""
    torch.manual_seed(0)
    model, x = ConvNet().double(), torch.randn(2, 3, 17, 17, dtype=torch.float64)
    module, compiled = _dispatched(model, x)
    assert offloaded_convs(compiled.stages["fast_math"]["forward"]) == 5
    errs = max_errors(run_step(module, (x,)), run_step(clone_module(model), (x,)))
    assert max(errs.values()) < 1e-10, errs


def _relax_weight_grad_operands(x: torch.Tensor, g: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CNHW data and IOHW kernel Relax's conv2d gradient writes a weight gradient with: the
    input with batch and group swapped (per-group channels as the batch), the output gradient."""
    n, c, h, w = x.shape
    data = x.reshape(n, groups, c // groups, h, w).permute(1, 0, 2, 3, 4).reshape(groups * n, c // groups, h, w)
    return data.contiguous(), g.contiguous()


@pytest.mark.parametrize(
    "groups,kernel,stride,padding,dilation,size",
    [
        (1, 3, 1, (1, 1, 1, 1), 1, (9, 8)),
        (1, 7, 2, (3, 3, 3, 3), 1, (33, 33)),  # the stride-2 stem: the stride does not divide the padded extent
        (4, 3, 1, (1, 1, 1, 1), 1, (10, 7)),  # depthwise
        (4, 5, 2, (2, 2, 2, 2), 1, (11, 12)),  # depthwise, strided
        (2, 3, 2, (0, 1, 1, 2), 1, (9, 10)),  # grouped, asymmetric padding
        (2, 3, 1, (2, 2, 2, 2), 2, (9, 9)),  # dilated
        (4, 3, 1, (1, 2, 1, 2), (2, 1), (8, 9)),  # dilation below the stride's place, one axis
    ],
)
def test_the_weight_gradient_is_aten_s(groups, kernel, stride, padding, dilation, size):
    """The packed weight gradient against ATen's ``convolution_backward`` of the forward
    convolution, over Relax's operands, for groups, strides, dilation and asymmetric padding."""
    gen = torch.Generator().manual_seed(0)
    dil = dilation if isinstance(dilation, tuple) else (dilation, dilation)
    x, w = torch.randn(3, 4, *size, generator=gen), torch.randn(8, 4 // groups, kernel, kernel, generator=gen)
    top, left, bottom, right = padding
    padded = torch.nn.functional.pad(x, (left, right, top, bottom))
    y = torch.nn.functional.conv2d(padded, w, None, stride, 0, dil, groups)
    g = torch.randn(y.shape, generator=gen)
    want = torch.ops.aten.convolution_backward(
        g, padded, w, None, (stride, stride), (0, 0), dil, False, (0, 0), groups, (False, True, False)
    )[1]
    data, kern = _relax_weight_grad_operands(x, g, groups)
    # the relax convolution's attributes: the forward's stride and dilation trade places
    attrs = tvm_ffi.Shape((*dil, *padding, stride, stride, groups, 1, 1, 1, 0))
    got = conv_kernels.conv2d_weight_grad(tvm_ffi.from_dlpack(data), tvm_ffi.from_dlpack(kern), attrs)
    got = torch.from_dlpack(got)
    torch.testing.assert_close(got[:, :, :kernel, :kernel], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "groups,kernel,stride,padding,dilation,size",
    [
        (1, 3, 1, 1, 1, (9, 8)),
        (1, 7, 2, 3, 1, (33, 33)),  # the stride does not divide the padded extent
        (4, 3, 1, 1, 1, (10, 7)),  # depthwise
        (4, 5, 2, 2, 1, (11, 12)),  # depthwise, strided: the weight gradient's extent computed larger
        (2, 3, 1, 2, 2, (9, 9)),  # grouped, dilated
    ],
)
def test_both_gradients_in_one_call_are_eager_s(groups, kernel, stride, padding, dilation, size):
    """The joint call is ATen's ``convolution_backward`` for both gradients, the call eager's
    autograd makes: bit for bit."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, *size, generator=gen), torch.randn(8, 4 // groups, kernel, kernel, generator=gen)
    y = torch.nn.functional.conv2d(x, w, None, stride, padding, dilation, groups)
    g = torch.randn(y.shape, generator=gen)
    want = torch.ops.aten.convolution_backward(
        g, x, w, None, (stride,) * 2, (padding,) * 2, (dilation,) * 2, False, (0, 0), groups, (True, True, False)
    )
    attrs = tvm_ffi.Shape((stride, stride, padding, padding, dilation, dilation, groups, 0, 0))
    dx, dw = conv_kernels.conv2d_backward(*(tvm_ffi.from_dlpack(t) for t in (g, x, w)), attrs)
    assert torch.equal(torch.from_dlpack(dx), want[0]) and torch.equal(torch.from_dlpack(dw), want[1])


class _Frozen(torch.nn.Module):
    """A frozen convolution (its input gradient alone) between two trained ones."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.frozen = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8).requires_grad_(False)
        self.last = torch.nn.Conv2d(8, 4, 3, padding=1, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.frozen(torch.relu(self.first(x))))).mean((2, 3))


def test_a_gradient_the_step_does_not_need_stays_unwritten():
    """Only convolutions whose two gradients are both written are paired: the frozen one computes
    its input gradient alone (the compiled step writes the input's gradient too: the first is
    paired); every gradient as eager's, none for the frozen weight."""
    torch.manual_seed(0)
    model, x = _Frozen(), torch.randn(2, 3, 12, 12)
    module = add_tvm_dispatch(clone_module(model), (x,))
    compiled = dispatcher_of(module).variants[0].compiled
    backward = compiled.stages["fast_math"]["backward"]
    names = [conv_kernels.CONV2D_BACKWARD, conv_kernels.CONV2D_TRANSPOSE, conv_kernels.CONV2D_WEIGHT_GRAD]
    assert [_calls(backward, n) for n in names] == [2, 1, 0], backward.script()
    module(x.clone()).square().sum().backward()
    ref = clone_module(model)
    ref(x.clone()).square().sum().backward()
    for (name, p), (_, q) in zip(module.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), name
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)
