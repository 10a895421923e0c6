"""Outputs and every gradient over grids of each op's parameters, in float64 against PyTorch (to
1e-9 of each tensor's largest value): convolutions (groups incl. depthwise, stride, padding,
dilation, kernel, odd/even and 1x1/2x2 maps, batch 1 and 2), train-mode BatchNorm over 1x1 and
2x2 maps (running statistics too), squeeze-excite, hard-swish/hard-sigmoid and adaptive pooling,
alone and as MobileNet/EfficientNet blocks on the tiny maps a 32x32 image leaves. Then
BatchNorm's float32 gradients, as accurate as eager's against float64.

Many configurations share one compile (a few seconds each): :class:`Parallel` applies its i-th
part to its i-th input. The full grids are ``@pytest.mark.slow``; by default a covering subset
runs (every value of every parameter, paired with the others in turn).
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tvmbridge import add_tvm_dispatch

from ..helpers import clone_module, is_tvm

F64 = torch.float64
TOL = 1e-9


class Parallel(nn.Module):
    """Part i applied to input i; every result an output."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p(x) for p, x in zip(self.parts, xs))


def step(module: nn.Module, inputs: tuple, compiled: bool = False) -> dict[str, torch.Tensor]:
    """Outputs, input and parameter gradients and buffers after one forward and backward, the
    output gradients drawn in float64 from a fixed generator (the same numbers in any dtype)."""
    inputs = tuple(x.detach().clone().requires_grad_(True) for x in inputs)
    outs = module(*inputs)
    assert not compiled or is_tvm(outs[0]), module._tvm_dispatch.explain()
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype) for o in outs]
    torch.autograd.backward(list(outs), grads)
    values = {f"out{i}": o.detach() for i, o in enumerate(outs)}
    values.update({f"input{i}": x.grad for i, x in enumerate(inputs)})
    values.update({n: p.grad for n, p in module.named_parameters()})
    values.update({f"buffer {n}": b.clone() for n, b in module.named_buffers()})
    return values


def compare(parts: list[nn.Module], inputs: tuple, reference=None,
            dtype: torch.dtype = F64) -> tuple[dict, dict, Parallel]:
    """``Parallel(parts)`` through the bridge and in PyTorch (``reference``: a transform of the
    PyTorch copy); returns both steps' tensors and the dispatched module."""
    m = Parallel(parts).to(dtype)
    ref = clone_module(m)
    if reference is not None:
        reference(ref)
    inputs = tuple(x.to(dtype) for x in inputs)
    add_tvm_dispatch(m, inputs)
    got, want = step(m, inputs, compiled=True), step(ref, inputs)
    assert not m._tvm_dispatch.discarded, m._tvm_dispatch.explain()
    return got, want, m


def check(parts: list[nn.Module], inputs: tuple, labels: list[str], reference=None) -> None:
    """Every output, gradient and buffer within ``TOL`` of PyTorch's, relative to its largest
    value; a failure names the configurations (``labels[i]`` for part i)."""
    got, want, _ = compare(parts, inputs, reference)
    assert got.keys() == want.keys()
    bad = {}
    for k, b in want.items():
        a = got[k]
        assert a is not None and b is not None and a.shape == b.shape, k
        if not b.is_floating_point() or b.numel() == 0:
            assert torch.equal(a, b), k
            continue
        scale = max(b.abs().max().item(), 1e-12)
        rel = (a - b).abs().max().item() / scale
        if not rel <= TOL:
            bad[f"{k} [{labels[part_index(k)]}]"] = rel
    assert not bad, f"{len(bad)} tensors off (relative error): {dict(sorted(bad.items(), key=lambda kv: -kv[1])[:12])}"


def part_index(key: str) -> int:
    """The part a tensor belongs to: ``out3``, ``input3``, ``parts.3.weight``, ``buffer parts.3...``."""
    name = key.removeprefix("buffer ")
    if name.startswith("parts."):
        return int(name.split(".")[1])
    return int(name.removeprefix("out").removeprefix("input"))


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# --- convolutions ----------------------------------------------------------------------------
GROUPS, STRIDES, PADDINGS, DILATIONS, KERNELS = ("1", "2", "depthwise"), (1, 2), (0, 1, 2), (1, 2), (1, 3, 5)
SIZES = ((1, 1), (2, 2), (5, 7), (3, 3), (4, 6), (7, 5))
BATCHES = (1, 2)


def conv_part(groups: str, stride: int, padding: int, dilation: int, kernel: int, size: tuple[int, int],
              batch: int, index: int) -> tuple[nn.Module, torch.Tensor, str]:
    """A Conv2d of this configuration (depthwise: 4 channels, multiplier 1 or 2; grouped: 2
    groups of 2 to 3 channels each) and its input; a map smaller than the dilated kernel's
    reach grows to fit it (PyTorch refuses it otherwise)."""
    cin, cout, g = {"1": (3, 5, 1), "2": (4, 6, 2), "depthwise": (4, 4 * (1 + index % 2), 4)}[groups]
    reach = dilation * (kernel - 1) + 1 - 2 * padding
    h, w = (max(d, reach) for d in size)
    torch.manual_seed(index)
    conv = nn.Conv2d(cin, cout, kernel, stride, padding, dilation, g, bias=index % 3 != 2)
    label = f"groups={groups} stride={stride} padding={padding} dilation={dilation} kernel={kernel} " \
            f"in=({batch}, {cin}, {h}, {w})"
    return conv, randn(batch, cin, h, w, seed=1000 + index), label


def check_convs(configs: list[tuple]) -> None:
    parts = [conv_part(*c, index=i) for i, c in enumerate(configs)]
    check([p for p, _, _ in parts], tuple(x for _, x, _ in parts), [label for _, _, label in parts])


@pytest.mark.parametrize("groups", GROUPS)
def test_conv2d_grid_covering(groups):
    """Every (stride, padding, dilation, kernel) for these groups, each with a map size and batch
    in turn: 1x1, 2x2, odd and even maps, batch 1 and 2."""
    combos = list(itertools.product(STRIDES, PADDINGS, DILATIONS, KERNELS))
    check_convs([(groups, *c, SIZES[i % len(SIZES)], BATCHES[(i // len(SIZES)) % 2]) for i, c in enumerate(combos)])


@pytest.mark.slow
@pytest.mark.parametrize("groups,stride", list(itertools.product(GROUPS, STRIDES)))
def test_conv2d_grid_full(groups, stride):
    check_convs(list(itertools.product([groups], [stride], PADDINGS, DILATIONS, KERNELS, SIZES, BATCHES)))


def test_conv2d_wide_channels():
    """Channel counts of timm's CNNs (the CPU schedules vectorize over wide axes): depthwise
    3x3/5x5 over 1x1 to 7x7 maps, stride 1 and 2, pointwise and grouped convolutions."""
    configs = [(144, 144, 5, 1, 2, 144, 2, 1), (144, 144, 5, 2, 2, 144, 2, 2), (96, 96, 3, 2, 1, 96, 1, 7),
               (48, 96, 3, 1, 1, 48, 2, 3), (40, 240, 1, 1, 0, 1, 2, 2), (64, 64, 3, 2, 1, 4, 1, 5)]
    parts, inputs, labels = [], [], []
    for i, (cin, cout, kernel, stride, padding, groups, batch, size) in enumerate(configs):
        torch.manual_seed(i)
        parts.append(nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups))
        inputs.append(randn(batch, cin, size, size, seed=i))
        labels.append(f"{cin}->{cout} kernel={kernel} stride={stride} padding={padding} groups={groups} "
                      f"in=({batch}, {cin}, {size}, {size})")
    check(parts, tuple(inputs), labels)


conv_configs = st.tuples(
    st.sampled_from(GROUPS), st.integers(1, 3), st.integers(0, 3), st.integers(1, 3), st.integers(1, 5),
    st.tuples(st.integers(1, 9), st.integers(1, 9)), st.integers(1, 3))


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(conv_configs, min_size=8, max_size=8))
def test_conv2d_random_configurations(configs):
    """Stride, padding and dilation up to 3, even kernels, batch 3: drawn, 8 per compile."""
    check_convs(configs)


def test_conv1d_grid():
    """The 1-D convolution's gradients (written as 2-D ones over a unit height)."""
    parts, inputs, labels = [], [], []
    combos = itertools.product((1, 4), (1, 2), (0, 2), (1, 2), (1, 3))
    for i, (groups, stride, padding, dilation, kernel) in enumerate(combos):
        length = (1, 6, 5, 2)[i % 4]
        reach = dilation * (kernel - 1) + 1 - 2 * padding
        length = max(length, reach)
        torch.manual_seed(i)
        parts.append(nn.Conv1d(4, 4 * (1 + i % 2), kernel, stride, padding, dilation, groups))
        inputs.append(randn(1 + i % 2, 4, length, seed=i))
        labels.append(f"groups={groups} stride={stride} padding={padding} dilation={dilation} kernel={kernel} "
                      f"length={length}")
    check(parts, tuple(inputs), labels)


def test_conv3d_grid():
    """The 3-D convolution's gradients (Relax has none: video models and LambdaNets were refused),
    strides that do not divide the padded extent included."""
    parts, inputs, labels = [], [], []
    combos = [(1, 1, 0, 1, 3), (2, 2, 1, 1, 3), (1, 2, 0, 2, 2), (2, 1, 1, 2, 3), (1, 3, 2, 1, 1), (2, 2, 0, 1, (3, 1, 2))]
    for i, (groups, stride, padding, dilation, kernel) in enumerate(combos):
        torch.manual_seed(i)
        parts.append(nn.Conv3d(4, 2 * (1 + i % 2), kernel, stride, padding, dilation, groups))
        inputs.append(randn(1 + i % 2, 4, 5 + i % 2, 6, 7 - i % 3, seed=i))
        labels.append(f"groups={groups} stride={stride} padding={padding} dilation={dilation} kernel={kernel}")
    check(parts, tuple(inputs), labels)


# --- BatchNorm -------------------------------------------------------------------------------
BN_SHAPES = ((2, 6, 1, 1), (3, 6, 1, 1), (2, 6, 2, 2), (1, 6, 2, 2), (2, 6, 1, 2), (4, 6, 3, 3), (2, 6, 5, 7),
             (1, 6, 1, 3), (4, 6), (2, 6, 5))


def batch_norm_part(shape: tuple[int, ...], index: int, train: bool) -> tuple[nn.Module, torch.Tensor, str]:
    """A BatchNorm of ``shape``'s rank with the index's variant of its options; channel means
    away from 0 (the case a centered gradient is for) and weights away from 1."""
    affine, track = index % 3 != 1, index % 4 != 3 or not train
    eps, momentum = (1e-5, 0.1) if index % 2 else (1e-3, 0.3)
    cls = nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d
    bn = cls(shape[1], eps=eps, momentum=momentum, affine=affine, track_running_stats=track).train(train)
    gen = torch.Generator().manual_seed(index)
    with torch.no_grad():
        if affine:
            bn.weight.copy_(torch.rand(shape[1], generator=gen) + 0.5)
            bn.bias.copy_(torch.randn(shape[1], generator=gen))
        if track:
            bn.running_mean.copy_(torch.randn(shape[1], generator=gen))
            bn.running_var.copy_(torch.rand(shape[1], generator=gen) + 0.5)
    shift = randn(1, shape[1], *[1] * (len(shape) - 2), seed=500 + index) * 3
    x = randn(*shape, seed=index) + shift
    label = f"{cls.__name__} {'train' if train else 'eval'} affine={affine} track={track} eps={eps} in={shape}"
    return bn, x, label


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm_grid(train):
    """1x1 maps of batch 2 and 3, 2x2 of batch 1 and 2, 1x2, odd maps, (N, C) and (N, C, L);
    affine or not, running statistics or not, two eps/momentum pairs. In train mode the new
    running statistics are compared too (buffers)."""
    cases = [batch_norm_part(s, i, train) for i, s in enumerate(BN_SHAPES)]
    check([p for p, _, _ in cases], tuple(x for _, x, _ in cases), [label for _, _, label in cases])


def test_batch_norm_float32_gradients_as_accurate_as_eager():
    """BatchNorm's gradients in float32 against float64: as accurate as PyTorch's own. Written as
    ATen's forward (``x * alpha + beta``) and differentiated as such, ``alpha`` got ``sum(g*x) -
    mean*sum(g)`` summed in float32: 40x eager's error on a 32x32 map of batch 16, 3x on 2x2 maps
    of batch 2 with a large channel mean. The bridge differentiates ``(x - mean) * alpha + b``
    with double channel sums, as ATen's backward computes."""
    shapes = [((16, 8, 32, 32), 1.0, 1.0), ((2, 8, 2, 2), 20.0, 0.1), ((2, 8, 1, 1), 5.0, 0.01)]
    parts, inputs = [], []
    for i, (shape, shift, spread) in enumerate(shapes):
        bn = nn.BatchNorm2d(shape[1])
        with torch.no_grad():
            bn.weight.copy_(torch.rand(shape[1], generator=torch.Generator().manual_seed(i)) + 0.5)
        parts.append(bn)
        inputs.append(shift + spread * randn(*shape, seed=i))
    labels = [str(s) for s in shapes]
    exact = step(Parallel(copy.deepcopy(parts)).double(), tuple(inputs))
    got, eager, m = compare(parts, tuple(inputs), dtype=torch.float32)
    bad = {}
    for k, ref in exact.items():
        if k.startswith("buffer"):
            continue
        scale = ref.abs().max().item()
        ours, theirs = ((t[k].double() - ref).abs().max().item() / scale for t in (got, eager))
        if ours > 2 * theirs + 1e-7:
            bad[f"{k} [{labels[part_index(k)]}]"] = (ours, theirs)
    assert not bad, f"float32 error relative to float64 (ours, eager's): {bad}"
    for k in got:  # ATen's forward arithmetic: outputs and running statistics to the bit
        if k.startswith(("out", "buffer")):
            assert torch.equal(got[k], eager[k]), k
    # the gradient path adds nothing to the forward nor to what the backward keeps: the outputs
    # are recomputed from the inputs and the channel statistics
    assert m._tvm_dispatch.variants[0].compiled.captured_bytes() < sum(x.numel() for x in inputs)


# --- squeeze-excite, hard activations, pooling: alone and as blocks ----------------------------
class SqueezeExcite(nn.Module):
    """timm's SE: channel means, reduce, activation, expand, gate."""

    def __init__(self, c: int, gate: nn.Module, act: nn.Module, pool: str = "mean") -> None:
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(c, max(1, c // 4), 1), nn.Conv2d(max(1, c // 4), c, 1)
        self.act, self.gate, self.pool = act, gate, pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True) if self.pool == "mean" else F.adaptive_avg_pool2d(x, 1)
        return x * self.gate(self.expand(self.act(self.reduce(s))))


class InvertedResidual(nn.Module):
    """MobileNetV3/EfficientNet's block: expand 1x1, BN, act, depthwise kxk (stride), BN, act,
    SE, project 1x1, BN, residual where the shape allows."""

    def __init__(self, c: int, out: int, kernel: int, stride: int, act: type, gate: type) -> None:
        super().__init__()
        mid = 2 * c
        self.body = nn.Sequential(
            nn.Conv2d(c, mid, 1, bias=False), nn.BatchNorm2d(mid), act(),
            nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=mid, bias=False), nn.BatchNorm2d(mid), act(),
            SqueezeExcite(mid, gate(), nn.ReLU()),
            nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out))
        self.residual = stride == 1 and c == out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class ExactHardsigmoid(nn.Module):
    """PyTorch's float64 ``hardsigmoid_backward`` multiplies by 1/6 rounded to float32 (5e-9 of
    it); the reference uses ``relu6(x + 3) / 6``, whose gradient is the exact 1/6."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(x + 3) / 6


def exact_hardsigmoid(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Hardsigmoid):
            setattr(module, name, ExactHardsigmoid())
        else:
            exact_hardsigmoid(child)


def test_squeeze_excite_activations_and_pooling():
    """SE with sigmoid and hard-sigmoid gates (means and adaptive pooling to 1x1), hard-swish and
    hard-sigmoid over values on and between their kinks, adaptive average pooling to 1x1 and
    to sizes that do not divide the map."""
    parts, inputs, labels = [], [], []

    def add(part: nn.Module, x: torch.Tensor, label: str) -> None:
        torch.manual_seed(len(parts))
        parts.append(part)
        inputs.append(x)
        labels.append(label)

    for i, (size, gate, pool) in enumerate(itertools.product(((1, 1), (2, 2), (3, 5)), (nn.Sigmoid, nn.Hardsigmoid),
                                                            ("mean", "adaptive"))):
        add(SqueezeExcite(8, gate(), nn.SiLU(), pool), randn(2, 8, *size, seed=i) * 2,
            f"SE {gate.__name__} {pool} {size}")
    kinks = torch.tensor([-4.0, -3.0, -2.0, 0.0, 2.0, 3.0, 4.0], dtype=F64)
    for act in (nn.Hardswish, nn.Hardsigmoid):
        add(act(), torch.cat([kinks, 4 * randn(40, seed=len(parts))]), act.__name__)
    for out in ((1, 1), (2, 2), (3, 2), (2, 3)):
        add(nn.AdaptiveAvgPool2d(out), randn(2, 3, 5, 7, seed=len(parts)), f"adaptive_avg_pool2d {out} of 5x7")
    check(parts, tuple(inputs), labels, reference=exact_hardsigmoid)


def test_mobile_blocks_on_tiny_maps():
    """The blocks timm's MobileNetV3 and EfficientNet end with on a 32x32 image: depthwise 3x3
    and 5x5, stride 1 and 2 (2x2 -> 1x1), BatchNorm in train mode over 2x2 and 1x1 maps of batch
    2, hard-swish and SiLU, hard-sigmoid and sigmoid gates; on 4x4, 2x2 and 1x1 inputs."""
    parts, inputs, labels = [], [], []
    for i, (kernel, stride, (act, gate)) in enumerate(itertools.product(
            (3, 5), (1, 2), ((nn.Hardswish, nn.Hardsigmoid), (nn.SiLU, nn.Sigmoid)))):
        size = ((2, 2), (4, 4), (1, 1))[i % 3]
        torch.manual_seed(i)
        parts.append(InvertedResidual(4, 4 if stride == 1 else 6, kernel, stride, act, gate).train())
        inputs.append(randn(2, 4, *size, seed=i) + 1)
        labels.append(f"kernel={kernel} stride={stride} {act.__name__}/{gate.__name__} in=(2, 4, {size[0]}, {size[1]})")
    check(parts, tuple(inputs), labels, reference=exact_hardsigmoid)
