"""FlopCounter (analysis.flops) against PyTorch's own FlopCounterMode and first principles."""
from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from analysis.profiling.flops import FlopCounter, count_op, is_torch_counted
from analysis.models import MODELS

from ..helpers import SMALL_SIZES as SMALL

logging.getLogger("transformers").setLevel(logging.ERROR)
aten = torch.ops.aten


def _build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, args = MODELS[name](**SMALL[name])
    return model, next(iter(args.values()))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _torch_counted(d: dict) -> dict:
    return {k: v for k, v in d.items() if is_torch_counted(k) and v}


@pytest.mark.parametrize("name", ["cnn", "bert", "gpt2"])
@pytest.mark.parametrize("input_grad", [False, True])
def test_totals_equal_pytorch_counter(name: str, input_grad: bool) -> None:
    model, x = _build(name)
    x.requires_grad_(input_grad)
    with FlopCounterMode(display=False) as ref:
        _first(model(x)).sum().backward()
    with FlopCounter() as fc:
        _first(model(x)).sum().backward()
    expected = _torch_counted(ref.get_flop_counts()["Global"])
    assert expected, "the reference counted nothing: the comparison would be empty"
    assert _torch_counted(fc.by_op()) == expected
    # and we count what PyTorch leaves at zero
    assert fc.total() > sum(expected.values())


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_forward_per_module_equals_pytorch(name: str) -> None:
    model, x = _build(name)
    with torch.no_grad(), FlopCounterMode(display=False) as ref:
        model(x)
    with torch.no_grad(), FlopCounter() as fc:
        model(x)
    for mod, ops in ref.get_flop_counts().items():
        assert _torch_counted(fc.by_op(mod, "forward")) == _torch_counted(ops), mod


def test_backward_attributed_to_module_that_made_it() -> None:
    model, x = _build("bert")
    x.requires_grad_(True)
    with FlopCounter() as fc:
        _first(model(x)).sum().backward()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 6
    for n in linears:
        name = f"{type(model).__name__}.{n}"
        fwd = fc.by_op(name, "forward")[aten.addmm]
        bwd = fc.by_op(name, "backward")[aten.mm]
        assert bwd == 2 * fwd, name  # grad input + grad weight, each a matmul of the forward size


@pytest.mark.parametrize("input_grad, factor", [(False, 1), (True, 2)])
def test_first_conv_backward(input_grad: bool, factor: int) -> None:
    model, x = _build("cnn")
    x.requires_grad_(input_grad)
    with FlopCounter() as fc:
        model(x).sum().backward()
    fwd = fc.by_op("SmallCNN.conv1", "forward")[aten.convolution]
    bwd = fc.by_op("SmallCNN.conv1", "backward")[aten.convolution_backward]
    assert fwd > 0 and bwd == factor * fwd


def test_frozen_weights() -> None:
    model, x = _build("bert")
    with FlopCounter() as full:
        _first(model(x)).sum().backward()
    for p in model.attention.parameters():
        p.requires_grad_(False)
    with FlopCounterMode(display=False) as ref:
        _first(model(x)).sum().backward()
    with FlopCounter() as fc:
        _first(model(x)).sum().backward()
    assert _torch_counted(fc.by_op()) == _torch_counted(ref.get_flop_counts()["Global"])
    # the four attention projections lose their weight gradient (one matmul of forward size)
    # and, with the input needing no grad, nothing flows below the attention's input
    saved = full.total("backward") - fc.total("backward")
    proj = sum(full.by_op(f"BertLayer.attention.{n}", "forward")[aten.addmm]
               for n in ("self.query", "self.key", "self.value", "output.dense"))
    assert saved >= proj
    assert fc.total("forward") == full.total("forward")


def _functional(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, w1)), w2).sum()


@pytest.mark.parametrize("transform", ["vmap", "jacrev", "hessian"])
def test_torch_func_transforms(transform: str) -> None:
    torch.manual_seed(0)
    w1, w2, x = torch.randn(6, 5), torch.randn(3, 6), torch.randn(5)
    fn = {
        "vmap": lambda: torch.func.vmap(lambda v: _functional(v, w1, w2))(torch.randn(4, 5)),
        "jacrev": lambda: torch.func.jacrev(_functional)(x, w1, w2),
        "hessian": lambda: torch.func.hessian(_functional)(x, w1, w2),
    }[transform]
    with FlopCounterMode(display=False) as ref:
        fn()
    with FlopCounter() as fc:
        fn()
    assert _torch_counted(fc.by_op()) == _torch_counted(ref.get_flop_counts()["Global"])

    # the same math through modules: PyTorch's counter breaks on jacrev/hessian here, ours not
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(5, 6, bias=False)
            self.b = torch.nn.Linear(6, 3, bias=False)
            self.a.weight.data, self.b.weight.data = w1.clone(), w2.clone()

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(v))).sum()

    m = M()
    mfn = {"vmap": lambda: torch.func.vmap(m)(torch.randn(4, 5)),
           "jacrev": lambda: torch.func.jacrev(m)(x),
           "hessian": lambda: torch.func.hessian(m)(x)}[transform]
    with FlopCounter() as fm:
        mfn()
    assert fm.total() > 0
    assert fm.total("forward", "M.a") > 0


def test_checkpoint_recompute_is_counted() -> None:
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            self.ckpt = ckpt
            self.block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x)
            return self.head(h)

    x = torch.randn(8, 16, requires_grad=True)
    plain, ckpt = Net(False), Net(True)
    ckpt.load_state_dict(plain.state_dict())
    with FlopCounter() as a:
        plain(x).sum().backward()
    with set_checkpoint_early_stop(False), FlopCounter() as b:
        ckpt(x).sum().backward()
    assert b.total("forward") == a.total("forward")
    block_fwd = a.by_op("Net.block", "forward")
    assert block_fwd[aten.addmm] > 0
    # every forward op of the block runs again during backward, attributed to the block
    for mod in ("Global", "Net", "Net.block"):
        extra = {k: b.by_op(mod, "backward").get(k, 0) - a.by_op(mod, "backward").get(k, 0)
                 for k in block_fwd}
        assert extra == block_fwd, mod
    assert b.by_op("Net.block.0", "backward")[aten.addmm] == a.by_op("Net.block.0", "forward")[aten.addmm]
    assert b.by_op("Net.head", "backward") == a.by_op("Net.head", "backward")
    # the total grows by at least the recomputation (checkpointing adds gradient accumulation)
    assert b.total("backward") >= a.total("backward") + sum(block_fwd.values())


class CkptNet(torch.nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=False) if self.ckpt else self.block(x))


@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpoint_attribution_does_not_leak(early_stop: bool) -> None:
    """With early stop (the default) the recomputation is cut off by an exception inside the
    block's last Linear, so its forward post-hooks never run: the re-run modules must not stay
    on the module stack and take the rest of the backward, or a later unrelated forward.

    Checked by hand against a run without checkpointing, not per module against PyTorch: its
    ModuleTracker charges block.0's recomputation to block.2 (open in backward while the
    recomputation runs inside its node) and, without early stop, the re-run block's forward
    post-hook removes the block from its set of open modules, so the block loses its backward."""
    torch.manual_seed(0)
    plain, ckpt, other = CkptNet(False), CkptNet(True), torch.nn.Linear(16, 16)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(8, 16, requires_grad=True)

    def run(net: CkptNet) -> None:
        net(x).sum().backward()
        other(x)  # after the backward: counts for `Linear` (its own root name) only

    with set_checkpoint_early_stop(early_stop), FlopCounterMode(display=False) as ref:
        run(ckpt)
    a, b = FlopCounter(), FlopCounter()
    with set_checkpoint_early_stop(early_stop):
        with a:
            run(plain)
        with b:
            run(ckpt)
    assert _torch_counted(b.by_op()) == _torch_counted(ref.get_flop_counts()["Global"])
    assert b.by_op("Linear") == {aten.addmm: 2 * 8 * 16 * 16}
    addmm = 2 * 8 * 16 * 32  # Linear(16, 32) or Linear(32, 16) on 8 rows
    # block.0's addmm runs again in backward; block.2's too unless early stop cut the
    # recomputation off first (autograd saves an op's inputs before running it)
    n = 1 if early_stop else 2
    recomputed = {"CkptNet.block.0": addmm, "CkptNet.block.2": (n - 1) * addmm,
                  "CkptNet.block": n * addmm, "CkptNet": n * addmm, "Global": n * addmm}
    assert set(b.counts) == set(a.counts)
    for m in a.counts:
        assert b.by_op(m, "forward") == a.by_op(m, "forward"), m
        before, after = _torch_counted(a.by_op(m, "backward")), _torch_counted(b.by_op(m, "backward"))
        extra = {op: after.get(op, 0) - before.get(op, 0) for op in set(before) | set(after)}
        assert {op: k for op, k in extra.items() if k} == (
            {aten.addmm: recomputed[m]} if recomputed.get(m) else {}), m


def test_cond_counts_the_larger_branch_like_pytorch() -> None:
    """``torch.cond`` (a higher-order op) used to raise; both counters charge, per module and
    op, the larger branch (fake tensors cannot tell which one a real run takes)."""

    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = torch.nn.Linear(8, 8)
            self.big = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cond(x.sum() > 0, lambda v: self.small(v), lambda v: self.big(v), (x,))

    torch.manual_seed(0)
    gate, x = Gate(), torch.randn(4, 8)
    # cond's backward under any dispatch mode fails inside PyTorch 2.13 (FlopCounterMode too)
    with torch.no_grad(), FlopCounterMode(display=False) as ref:
        out_ref = gate(x)
    with torch.no_grad(), FlopCounter() as fc:
        out = gate(x)
    torch.testing.assert_close(out, out_ref)
    expected = {m: _torch_counted(ops) for m, ops in ref.get_flop_counts().items()}
    assert {m: _torch_counted(fc.by_op(m)) for m in fc.counts} == expected
    assert fc.by_op("Gate.big", "forward")[aten.addmm] == 2 * 2 * 4 * 8 * 32
    assert fc.by_op("Gate", "forward")[aten.addmm] == 2 * 2 * 4 * 8 * 32  # max, not the sum


def test_other_higher_order_ops_count_what_runs() -> None:
    """A higher-order op other than cond runs its eager kernel under the counter (PyTorch's
    returns NotImplemented as the result): a while loop's body counts once per iteration."""
    from torch._higher_order_ops import while_loop

    w, x = torch.randn(8, 8), torch.randn(4, 8)
    with FlopCounter() as fc:
        _, out = while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v @ w), (torch.tensor(0), x))
    torch.testing.assert_close(out, x @ w @ w @ w)
    assert fc.by_op()[aten.mm] == 3 * 2 * 4 * 8 * 8


def test_safe_softmax_counts_like_softmax() -> None:
    """The math SDPA (taken on CPU with dropout) uses ``_safe_softmax``, whose backward is the
    plain softmax backward: forward 5 per element, backward 4, as for ``_softmax``."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    with FlopCounter() as fc:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1).sum().backward()
    scores = 2 * 4 * 8 * 8
    assert fc.by_op(phase="forward").get(aten._safe_softmax) == 5 * scores
    assert fc.by_op(phase="backward").get(aten._softmax_backward_data) == 4 * scores


def test_stated_conventions() -> None:
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    assert count_op(aten.add.Tensor, (a, b), {}, a + b) == 20
    assert count_op(aten.mm.default, (a, b.t()), {}, a @ b.t()) == 2 * 4 * 4 * 5  # multiply-add = 2
    s = torch.softmax(a, -1)
    assert count_op(aten._softmax.default, (a, -1, False), {}, s) == 5 * 20
    assert count_op(aten.sum.dim_IntList, (a, [1]), {}, a.sum(1)) == 20
    assert count_op(aten.clone.default, (a,), {}, a.clone()) == 0
    with FlopCounter() as fc:
        torch.nn.functional.layer_norm(a, (5,), torch.ones(5), torch.zeros(5))
    assert fc.total() == 7 * 20
    with FlopCounter() as fc:
        torch.nn.functional.gelu(a)
    assert fc.total() == 5 * 20


def test_table_has_modules_and_units() -> None:
    model, x = _build("cnn")
    with FlopCounter() as fc:
        model(x).sum().backward()
    t = fc.table(depth=2)
    assert "SmallCNN.conv1" in t and "FLOP" in t and "Backward" in t
