"""``torch.compile(model, backend="tvmbridge")``: every graph dynamo captures trains through TVM,
with PyTorch's loss and every gradient, in the ways users compile (whole models, graph breaks,
``dynamic=True``, ``fullgraph=True``, checkpointing, no_grad regions, BatchNorm's buffers)."""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn

import tvmbridge
from tvmbridge import FallbackWarning, VerificationWarning
from tvmbridge.dynamo import Backend

from ..helpers import bert_inputs, bert_layer
from ..helpers import strict_net as _strict

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(model: nn.Module, seed: int, *args, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    if hasattr(out, "loss"):
        loss = out.loss
    else:  # a fixed random weighting: a normalized output's square would cancel to noise
        out = out[0] if isinstance(out, tuple) else out
        loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))).sum()
    loss.backward()
    return loss.detach()


def _assert_same_grads(model: nn.Module, ref: nn.Module, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _all_compiled(backend: Backend) -> None:
    assert backend.graphs, "dynamo passed no graph"
    for g in backend.graphs:
        d = g.dispatcher
        assert d.calls_tvm > 0 and d.calls_fallback == 0 and not d.discarded, backend.explain()


def _train_side_by_side(model: nn.Module, backend: Backend, batches: list[dict], compile_kwargs: dict | None = None,
                        steps_with_optimizer: bool = True) -> None:
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, **(compile_kwargs or {}))
    # SGD: Adam's normalised step turns float noise in a near-zero gradient into a full-size update
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, ref)]
    for step, batch in enumerate(batches):
        got = _step(compiled, step, **batch)
        want = _step(ref, step, **batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        _assert_same_grads(model, ref)
        if steps_with_optimizer:
            for m, opt in zip((model, ref), opts):
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
    for a, b in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b)


def test_the_backend_is_registered_by_name() -> None:
    assert "tvmbridge" in torch._dynamo.list_backends()


def test_bert_layer_fullgraph_trains_as_eager() -> None:
    layer = bert_layer(small=True)
    hidden, mask = bert_inputs(batch=2, seq=8, hidden=64)
    backend = tvmbridge.compile_backend()
    with _strict():
        _train_side_by_side(layer, backend, [{"hidden_states": hidden, "attention_mask": mask}] * 2,
                            {"fullgraph": True})
    _all_compiled(backend)
    assert len(backend.graphs) == 1


def _mlm() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg)


def _mlm_batch(length: int, seed: int) -> dict:
    ids = torch.randint(0, 120, (2, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_bert_for_masked_lm_trains_as_eager_one_graph_for_every_length() -> None:
    """model(**batch) with an optimizer and clipping; dynamo recompiles once for a new length (its automatic
    dynamic shapes) and the bridge compiles that graph symbolically: later lengths compile nothing."""
    backend = tvmbridge.compile_backend()
    with _strict():
        _train_side_by_side(_mlm(), backend, [_mlm_batch(n, i) for i, n in enumerate((12, 16, 9, 14))])
    _all_compiled(backend)
    assert len(backend.graphs) == 2, backend.explain()
    dynamic = backend.graphs[1].dispatcher
    assert len(dynamic.variants) == 1 and dynamic.variants[0].symbolic, backend.explain()


class Breaks(nn.Module):
    """A data-dependent branch and a print in the middle: dynamo captures three graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.a(x)))
        if h.sum() > 0:  # a value decides: a graph break
            h = h * 2
        h = self.b(h).relu()
        torch._dynamo.graph_break()
        return self.c(self.drop(h))


def test_a_model_with_graph_breaks_trains_as_eager() -> None:
    torch.manual_seed(0)
    backend = tvmbridge.compile_backend()
    batches = [{"x": torch.randn(6, 8, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    with _strict():
        _train_side_by_side(Breaks(), backend, batches)
    _all_compiled(backend)
    assert len(backend.graphs) >= 3, backend.explain()


class Mixed(nn.Module):
    """BatchNorm (buffers written in place), dropout, a no_grad region, a detach and a checkpointed block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.bn(self.fc(x))).relu()
        with torch.no_grad():
            z = y * 2
        y = torch.utils.checkpoint.checkpoint(self.fc2, y + z + y.detach(), use_reentrant=False)
        return y


def test_buffers_no_grad_detach_and_checkpoint_as_eager() -> None:
    """Without the safety net: the compiled code itself gets BatchNorm's running statistics, the
    gradient through a no_grad region and a detach, and a checkpointed block right."""
    torch.manual_seed(0)
    backend = tvmbridge.compile_backend(verify=False)
    batches = [{"x": torch.randn(8, 16, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    with _strict():
        _train_side_by_side(Mixed(), backend, batches)
    _all_compiled(backend)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16, eps=1e-6)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.drop(self.fc(x))).view(x.shape[0], -1, 4)


def test_dynamic_true_one_symbolic_variant_with_float_attributes() -> None:
    """dynamic=True: sizes arrive as SymInts and the modules' floats (eps, p) as 0-d tensors read
    with .item(); one symbolic variant serves every batch size, the floats compiled in and guarded."""
    torch.manual_seed(0)
    backend = tvmbridge.compile_backend()
    batches = [{"x": torch.randn(n, 16, generator=torch.Generator().manual_seed(n))} for n in (4, 7, 5)]
    model = Scaled()
    with _strict():
        _train_side_by_side(model, backend, batches, {"dynamic": True})
    _all_compiled(backend)
    assert len(backend.graphs) == 1
    d = backend.graphs[0].dispatcher
    assert len(d.variants) == 1 and d.variants[0].symbolic, backend.explain()
    model.drop.p = 0.5  # dynamo passes the new float; the variant's guard sees it and compiles anew
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(6, 16)
    with _strict():
        torch.testing.assert_close(_step(compiled, 7, x), _step(ref, 7, x))
    _assert_same_grads(model, ref)


def test_no_grad_and_eval_calls_as_eager() -> None:
    model = _mlm()
    ref = copy.deepcopy(model)
    backend = tvmbridge.compile_backend()
    compiled = torch.compile(model, backend=backend)
    batch = _mlm_batch(10, 0)
    def seeded(m: nn.Module) -> torch.Tensor:
        torch.manual_seed(0)  # train mode under no_grad: dropout draws
        return m(**batch).logits

    with _strict(), torch.no_grad():
        torch.testing.assert_close(seeded(compiled), seeded(ref), rtol=1e-5, atol=1e-5)
        model.eval(), ref.eval()
        torch.testing.assert_close(seeded(compiled), seeded(ref), rtol=1e-5, atol=1e-5)
    _all_compiled(backend)


class Unconvertible(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.i1e(self.fc(x)).sum(-1)  # no Relax converter


def test_a_graph_the_bridge_cannot_convert_runs_pytorch_with_a_warning() -> None:
    model = Unconvertible()
    ref = copy.deepcopy(model)
    backend = tvmbridge.compile_backend()
    x = torch.randn(3, 8)
    with pytest.warns(FallbackWarning, match="i1e"):
        got = _step(torch.compile(model, backend=backend), 0, x)
    torch.testing.assert_close(got, _step(ref, 0, x))
    _assert_same_grads(model, ref)
    assert "i1e" in backend.explain()


class PartlyConvertible(nn.Module):
    """Two ops without a converter between layers: one output (i1e), two outputs (cummax)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x).tanh()
        h = torch.special.i1e(h) + h
        values, _ = torch.cummax(h, dim=-1)
        return self.fc3(self.fc2(values).relu())


def _leaf_graphs(backend: Backend) -> list:
    """The compiled graphs that run (a graph split at first call runs through its pieces)."""
    out, todo = [], list(backend.graphs)
    while todo:
        g = todo.pop()
        if g.split is None:
            out.append(g)
        else:
            todo.extend(g.split.pieces.values())
    return out


def test_a_graph_is_split_at_the_ops_the_bridge_cannot_convert() -> None:
    """PyTorch runs just those ops (each found on a piece's first call: a piece holding the next
    one splits again); TVM runs every layer, forward and backward, as eager computes them."""
    torch.manual_seed(0)
    model = PartlyConvertible()
    backend = tvmbridge.compile_backend()
    with pytest.warns(FallbackWarning, match="split at") as caught:
        _train_side_by_side(model, backend, [{"x": torch.randn(b, 8)} for b in (4, 4, 6, 3)])
    said = " ".join(str(w.message) for w in caught)
    assert "special_i1e" in said and "cummax" in said
    leaves = _leaf_graphs(backend)
    assert len(leaves) >= 3
    for g in leaves:
        d = g.dispatcher
        assert d.calls_tvm > 0 and d.calls_fallback == 0 and not d.discarded, backend.explain()
    assert "split around" in backend.explain() and "cummax" in backend.explain()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(torch.ones(2, 8)), model(torch.ones(2, 8)))


def test_compile_backend_options_reach_the_graphs() -> None:
    backend = tvmbridge.compile_backend(capture="all", fallback=False)
    assert backend.options.capture == "all" and backend.options.fallback is False
    compiled = torch.compile(Unconvertible(), backend=backend)
    for _ in range(2):  # every call, not only the first
        with pytest.raises(Exception, match="i1e"):
            compiled(torch.randn(3, 8))


def test_a_deep_copy_of_a_compiled_model_trains_as_eager() -> None:
    """timm's ModelEmaV2 deep-copies the model it is given, compiled or not."""
    backend = tvmbridge.compile_backend()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(5, 8)
    _step(compiled, 0, x)
    twin = copy.deepcopy(compiled)
    assert twin._orig_mod is not model and next(twin.parameters()) is not next(model.parameters())
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        for p in ref.parameters():
            p.mul_(0.5)
    ref.zero_grad()
    twin.zero_grad()
    with _strict():
        torch.testing.assert_close(_step(twin, 1, x), _step(ref, 1, x))
    _assert_same_grads(twin._orig_mod, ref)
    _all_compiled(backend)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Dropout(0.1)) for _ in range(3)])
        self.head = nn.Linear(512, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = Tower()
        ref = copy.deepcopy(model)
        # 1 MiB buckets (DDP's first-bucket size, the least the DDP optimizer takes), one layer each: dynamo's DDP optimizer splits the graph at their boundaries
        ddp, ddp_ref = (DDP(m, bucket_cap_mb=1) for m in (model, ref))
        backend = tvmbridge.compile_backend()
        compiled = torch.compile(ddp, backend=backend)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
        worst = 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("error", VerificationWarning)
            warnings.simplefilter("error", FallbackWarning)
            for step in range(3):
                x = torch.randn(8, 512, generator=torch.Generator().manual_seed(10 * step + rank))
                for m, opt in ((compiled, opts[0]), (ddp_ref, opts[1])):
                    torch.manual_seed(step + rank)
                    m(x).square().mean().backward()
                worst = max(worst, *((p.grad - q.grad).abs().max().item()
                                     for p, q in zip(model.parameters(), ref.parameters())))
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
        compiled_calls = [g.dispatcher.calls_tvm for g in backend.graphs]
        fallbacks = sum(g.dispatcher.calls_fallback for g in backend.graphs)
        torch.save({"worst": worst, "graphs": len(backend.graphs), "calls": compiled_calls, "fallbacks": fallbacks,
                    "params": [p.detach() for p in model.parameters()],
                    "ref": [p.detach() for p in ref.parameters()]}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_distributed_data_parallel_on_gloo_trains_as_eager(tmp_path) -> None:
    """Two processes, gloo on CPU; dynamo's DDP optimizer hands the backend one graph per bucket;
    the gradients PyTorch all-reduces are TVM's, and every rank ends with eager DDP's weights."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in results:
        assert r["graphs"] >= 2 and all(c > 0 for c in r["calls"]) and r["fallbacks"] == 0, r
        assert r["worst"] < 1e-5, r["worst"]
        for p, q in zip(r["params"], r["ref"]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p, q in zip(results[0]["params"], results[1]["params"]):  # all-reduced: the ranks agree
        torch.testing.assert_close(p, q, rtol=0, atol=0)


class StraightThrough(torch.autograd.Function):
    """A hand-written backward that is not the forward's gradient (round's is zero)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (StraightThrough.apply(self.fc(x)) * x).sum()


def test_a_custom_autograd_function_keeps_its_own_backward() -> None:
    """Traced, its forward is all that is left: the bridge must not differentiate it (a zero
    gradient here). The backend splits the graph around it: PyTorch runs the Function, TVM the
    pieces before and after; add_tvm_dispatch, which has no graph to split, refuses it."""
    model = Quantized()
    ref = copy.deepcopy(model)
    backend = tvmbridge.compile_backend(verify=False)
    x = torch.randn(3, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with _strict():
        torch.compile(model, backend=backend)(x).backward()
    ref(x_ref).backward()
    _assert_same_grads(model, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    _all_compiled(backend)
    assert len(backend.graphs) == 2 and "split around autograd_function_apply" in backend.explain()
    with pytest.raises(tvmbridge.ConversionError, match="custom autograd.Function .StraightThrough."):
        tvmbridge.add_tvm_dispatch(copy.deepcopy(ref), (x_ref.detach(),), verify=False)
    assert torch.autograd.Function.__dict__["apply"].__func__.__name__ == "apply"  # the patch is undone


def test_the_registered_name_takes_options() -> None:
    """torch.compile's ``options`` reach CompileOptions; a wrong field says so."""
    layer = bert_layer(small=True)
    hidden, mask = bert_inputs(batch=2, seq=8, hidden=64)
    ref = copy.deepcopy(layer)
    compiled = torch.compile(layer, backend="tvmbridge", options={"capture": "all", "verify": False})
    with _strict():
        got = _step(compiled, 0, hidden, mask)
    torch.testing.assert_close(got, _step(ref, 0, hidden, mask))
    _assert_same_grads(layer, ref)
    from tvmbridge.dynamo.backend import _backend_for

    backend = _backend_for({"capture": "all", "verify": False})
    assert backend.options.capture == "all" and backend.graphs
    _all_compiled(backend)
    with pytest.raises(Exception, match="no_such_option"):
        torch.compile(copy.deepcopy(ref), backend="tvmbridge", options={"no_such_option": 1})(hidden, mask)


def test_inductors_modes_compile_as_the_default_and_say_so() -> None:
    """A user coming from inductor passes ``mode``: a known one compiles (with a warning naming what
    stands for it here), another is an error naming the modes; a backend object takes no options."""
    from tvmbridge.dynamo.backend import _backend_for

    _backend_for({})._said_modes.discard("max-autotune")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    x = torch.randn(5, 8)
    with pytest.warns(UserWarning, match="tuning_db"):
        got = _step(torch.compile(model, backend="tvmbridge", mode="max-autotune"), 0, x)
    torch.testing.assert_close(got, _step(ref, 0, x))
    _assert_same_grads(model, ref)
    with pytest.raises(Exception, match="not a mode tvmbridge knows"):
        torch.compile(copy.deepcopy(ref), backend="tvmbridge", mode="max-speed")(x)
    with pytest.raises(Exception, match=r"compile_backend\(\*\*\{'verify': False\}\)"):
        torch.compile(copy.deepcopy(ref), backend=tvmbridge.compile_backend(), options={"verify": False})(x)


def test_autocast_around_the_compiled_model_is_compiled_in() -> None:
    """Called under torch.autocast: the graph's casts are traced under it and the net (bfloat16
    tolerances) accepts the result; a call without autocast is another variant, in float32."""
    layer = bert_layer(small=True)
    ref = copy.deepcopy(layer)
    hidden, mask = bert_inputs(batch=2, seq=8, hidden=64)
    backend = tvmbridge.compile_backend()
    compiled = torch.compile(layer, backend=backend)
    def seeded(m: nn.Module) -> torch.Tensor:
        torch.manual_seed(0)  # dropout draws
        out = m(hidden, mask)
        return out[0] if isinstance(out, tuple) else out

    with _strict():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = seeded(compiled), seeded(ref)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)
        got.float().sum().backward()
        torch.testing.assert_close(seeded(compiled), seeded(ref), rtol=1e-5, atol=1e-5)
    _all_compiled(backend)
    assert "autocast(cpu, bfloat16)" in backend.explain()


class SizeAcrossBreak(nn.Module):
    """A graph that hands a size on to the Python after it (dynamo outputs it as a SymInt)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        n = h.shape[0] * 2 + 1
        torch._dynamo.graph_break()
        return h.sum(0) * n


def test_sizes_a_graph_hands_on_are_worked_out_from_the_call() -> None:
    torch.manual_seed(0)
    backend = tvmbridge.compile_backend()
    batches = [{"x": torch.randn(n, 8, generator=torch.Generator().manual_seed(n))} for n in (3, 5, 4)]
    with _strict():
        _train_side_by_side(SizeAcrossBreak(), backend, batches, {"dynamic": True})
    _all_compiled(backend)
    assert any(g.outputs.others for g in backend.graphs), "no graph handed a size on"


class QuantizedWithState(nn.Module):
    """A custom Function between a no_grad block, dropout and a counter written in place: the pieces
    around it must keep the grad mode, the draws and the write where eager has them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        self.drop = nn.Dropout(0.3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        with torch.no_grad():
            target = self.fc2(h) * 2
        self.calls.add_(1)
        q = StraightThrough.apply(h)
        return ((self.fc2(self.drop(q)) - target) ** 2).sum() * self.calls


def test_pieces_of_a_split_graph_keep_grad_mode_draws_and_writes() -> None:
    torch.manual_seed(0)
    backend = tvmbridge.compile_backend(verify=False)
    batches = [{"x": torch.randn(5, 4, generator=torch.Generator().manual_seed(i))} for i in range(2)]
    with _strict():
        _train_side_by_side(QuantizedWithState(), backend, batches)
    _all_compiled(backend)
    assert "split around autograd_function_apply" in backend.explain()


@torch.library.custom_op("tvmbridge_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@_scaled.register_fake
def _scaled_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_scaled.register_autograd(lambda ctx, grad: grad * 5)  # on purpose not the forward's derivative


class WithLibraryOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_scaled(self.a(x)).tanh())


def test_a_torch_library_op_runs_in_pytorch_with_its_registered_backward() -> None:
    """A custom op (``torch.library``, as transformers' grouped_mm is) stays one node in the trace,
    with no converter: the graph is split there, PyTorch runs the op and its own backward."""
    torch.manual_seed(0)
    backend = tvmbridge.compile_backend()
    with pytest.warns(FallbackWarning, match="split at scaled"):
        _train_side_by_side(WithLibraryOp(), backend, [{"x": torch.randn(4, 8)} for _ in range(2)])
    leaves = _leaf_graphs(backend)
    assert len(leaves) == 2 and all(g.dispatcher.calls_tvm == 2 for g in leaves), backend.explain()


def test_a_graph_that_cannot_be_cut_runs_pytorch_whole(monkeypatch) -> None:
    """Where the split itself fails, the user's step still runs: PyTorch, with a warning."""
    import tvmbridge.dynamo.backend as backend_module

    def refuse(*args, **kwargs):
        raise ValueError("cannot cut here")

    monkeypatch.setattr(backend_module, "SplitGraph", refuse)
    torch.manual_seed(0)
    backend = tvmbridge.compile_backend()
    with pytest.warns(FallbackWarning, match="fell back"):
        _train_side_by_side(PartlyConvertible(), backend, [{"x": torch.randn(4, 8)} for _ in range(2)])
    assert all(g.split is None and g.dispatcher.calls_fallback == 2 for g in backend.graphs), backend.explain()


def _discriminator() -> nn.Module:
    sn = torch.nn.utils.parametrizations.spectral_norm
    return nn.Sequential(
        sn(nn.Conv2d(3, 8, 3, padding=1)), nn.LeakyReLU(0.2), sn(nn.Conv2d(8, 4, 3, stride=2)),
        nn.Flatten(), sn(nn.Linear(4 * 7 * 7, 1)),
    )


def test_spectral_norm_scored_twice_before_one_backward_trains_as_eager() -> None:
    """A GAN's discriminator on real and fake images, then one backward: dynamo's graph returns
    the power iteration's vectors, which are the module's buffers themselves (``normalize(...,
    out=u)``). They come back as those buffers, as from PyTorch: a fresh tensor over the memory
    the backward reads became the buffer, and the next call's power iteration wrote into it
    ("modified by an inplace operation" at backward)."""
    torch.manual_seed(0)
    model = _discriminator()
    ref = copy.deepcopy(model)
    backend = tvmbridge.compile_backend()
    compiled = torch.compile(model, backend=backend)
    buffers = [b for _, b in model.named_buffers()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref)]
    for step in range(3):
        real, fake = (torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(10 * step + i)) for i in (0, 1))
        with _strict():
            got = compiled(real).mean() - compiled(fake).mean()
            got.backward()
        want = ref(real).mean() - ref(fake).mean()
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        _assert_same_grads(model, ref)
        for (name, a), b in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(a, b, msg=name)
        for m, opt in zip((model, ref), opts):
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(a is b for a, (_, b) in zip(buffers, model.named_buffers()))  # the same buffers, updated
    _all_compiled(backend)


class SpectralWithCummax(nn.Module):
    """Spectral-normed layers around an op the bridge cannot convert: the graph is split, the
    power iteration is a piece of its own under no_grad, the next layer's piece reads its vectors."""

    def __init__(self) -> None:
        super().__init__()
        sn = torch.nn.utils.parametrizations.spectral_norm
        self.a, self.b = sn(nn.Linear(8, 16)), sn(nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = torch.cummax(self.a(x).tanh(), dim=-1)
        return self.b(h)


def test_split_spectral_norm_pieces_run_under_their_grad_mode_and_save_copies() -> None:
    """Each piece is traced under the grad mode it runs under (its ``normalize(..., out=u)`` on a
    weight that requires grad failed under the trace's grad mode: PyTorch ran it), and a piece
    whose forward clones an input its backward reads saves that copy (the input itself, written
    by the next call's power iteration before the backward, failed the version check)."""
    torch.manual_seed(0)
    model = SpectralWithCummax()
    ref = copy.deepcopy(model)
    backend = tvmbridge.compile_backend()
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # the split at cummax, said once
        warnings.simplefilter("error", VerificationWarning)
        for step in range(2):
            real, fake = (torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + i)) for i in (0, 1))
            got = compiled(real).mean() - compiled(fake).mean()
            got.backward()
            want = ref(real).mean() - ref(fake).mean()
            want.backward()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            _assert_same_grads(model, ref)
            for (name, a), b in zip(model.named_buffers(), ref.buffers()):
                torch.testing.assert_close(a, b, msg=name)
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
    for g in _leaf_graphs(backend):
        assert g.dispatcher.calls_tvm > 0 and g.dispatcher.calls_fallback == 0, backend.explain()


def test_a_graph_captured_under_no_grad_is_traced_under_it() -> None:
    """A discriminator in train mode scored under ``no_grad`` (its power iteration still steps):
    the graph dynamo captures there writes ``u`` with ``out=`` from a weight that requires grad,
    valid only without grad; traced with grad on, it ran PyTorch."""
    torch.manual_seed(0)
    model = _discriminator()
    ref = copy.deepcopy(model)
    backend = tvmbridge.compile_backend()
    x = torch.randn(4, 3, 16, 16)
    with _strict(), torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(torch.compile(model, backend=backend)(x), ref(x), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, msg=name)
    _all_compiled(backend)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def test_a_whole_compiled_train_step_leaves_the_bridges_backward_to_autograd() -> None:
    """``torch.compile(train_step)``: forward, ``loss.backward()``, clipping and the optimizer in
    one compiled function. Autograd calls the bridge's backward from a frame dynamo is compiling;
    dynamo traced it (and the first-call check's PyTorch reference inside it) into graphs of its
    own, compiled by this backend. It must stay opaque: every graph dynamo passes is the user's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    backend = tvmbridge.compile_backend()
    step = torch.compile(_train_step, backend=backend)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (8, 8, 5):
            x, y = torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)
            torch.testing.assert_close(step(model, opts[0], x, y), _train_step(ref, opts[1], x, y))
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    traces = [n.meta.get("stack_trace") or "" for c in backend.graphs for n in c.source.graph.nodes]
    package = os.path.dirname(tvmbridge.__file__)
    assert not [t for t in traces if package in t], "dynamo traced the bridge's own code"
    assert any(c.dispatcher.calls_tvm > 0 for c in backend.graphs), backend.explain()
    # the optimizer's graph runs PyTorch, and the warning says which graph (the user's line) and why
    said = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert any("a torch.compile graph (adam" in m and "an optimizer's step" in m for m in said), said
