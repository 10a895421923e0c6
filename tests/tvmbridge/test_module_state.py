"""State a forward changes besides its outputs, against PyTorch over several calls with
``verify=False`` (the first-call check must not be what makes these right): buffers assigned anew
(``self.n = self.n + 1``, a table rebuilt at another shape), plain attributes (a counter, a cache
filled on first use) and tensors kept on the module. Before, a trace's assignments stayed on the
module (fake tensors, a counter one ahead) and compiled calls made none: a buffer counter stayed
at 0 and every output after the first was wrong."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

from tests.helpers import clone_module, is_tvm
from tvmbridge import ConversionError, add_tvm_dispatch


class Counter(torch.nn.Module):
    """A step counter kept in a buffer, assigned anew each call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return self.lin(x) * self.count


class Table(torch.nn.Module):
    """ConViT's pattern: a buffer rebuilt at the input's size when it differs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.zeros(1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table.shape[0] != x.shape[0]:
            self.table = torch.arange(x.shape[0] * 4, dtype=x.dtype).reshape(x.shape[0], 4)
        return self.lin(x) * self.table


class LazyCache(torch.nn.Module):
    """Rotary tables of older transformers code: filled on first use, grown for longer inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cached_len = 0
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.cached_len:
            self.cached_len = x.shape[0]
            self.table = torch.arange(x.shape[0], dtype=x.dtype) * 2
        assert self.table is not None
        return self.lin(x) * self.table[: x.shape[0], None]


class PlainCounter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


class RunningMean(torch.nn.Module):
    """A statistic kept as training code writes it: in place, under no_grad, with ``alpha``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
                self.steps += 1
        return self.lin(x - self.mean)


class KeepsLast(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.last = y.detach()
        return y


def train_side_by_side(make, rows: list[int], sample: bool, fallback: bool = False) -> tuple:
    """Both copies through the same calls and SGD steps; the dispatched one, and PyTorch's."""
    torch.manual_seed(0)
    ref = make()
    m = add_tvm_dispatch(make(), (torch.randn(rows[0], 4),) if sample else None, verify=False, fallback=fallback)
    m.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1) for mod in (m, ref)]
    for n in rows:
        x = torch.randn(n, 4)
        for mod, opt in zip((m, ref), opts):
            opt.zero_grad()
            out = mod(x)
            out.square().sum().backward()
            opt.step()
            mod.out = out.detach()
        torch.testing.assert_close(m.out, ref.out)
        for (name, a), (_, b) in zip(m.named_buffers(), ref.named_buffers()):
            torch.testing.assert_close(a, b, msg=name)
        for a, b in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b)
    return m, ref


@pytest.mark.parametrize("sample", [True, False], ids=["ahead_of_time", "at_first_call"])
@pytest.mark.parametrize("make", [Counter, Table, RunningMean], ids=["counter", "table", "running_mean"])
def test_buffers_assigned_anew_are_kept(make, sample):
    m, _ = train_side_by_side(make, [3, 3, 2, 3], sample)
    assert re.search(r"calls: 4 compiled, 0 PyTorch", m._tvm_dispatch.explain()), m._tvm_dispatch.explain()


@pytest.mark.parametrize("sample", [True, False], ids=["ahead_of_time", "at_first_call"])
def test_a_cache_filled_in_forward_is_filled_by_pytorch_then_read(sample):
    with pytest.warns(UserWarning, match=r"assigns module attributes \(LazyCache.cached_len, LazyCache.table\)"):
        m, ref = train_side_by_side(LazyCache, [3, 3, 2, 5, 5], sample)
    assert m.cached_len == ref.cached_len == 5
    assert type(m.table) is torch.Tensor  # never a tracer's fake tensor
    assert "3 compiled" in m._tvm_dispatch.explain()  # PyTorch at the calls that grow the cache only


def test_a_counter_in_forward_is_an_error_that_says_what_to_do():
    m = add_tvm_dispatch(PlainCounter(), (torch.randn(3, 4),), verify=False)
    assert m.calls == 0  # the trace's increment undone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(torch.randn(3, 4))  # PyTorch's call
    assert m.calls == 1
    with pytest.raises(ConversionError, match="on every call .*PlainCounter.calls.*register_buffer"):
        m(torch.randn(3, 4))
    m, ref = train_side_by_side(PlainCounter, [3, 3, 3], sample=False, fallback=True)
    assert m.calls == ref.calls == 3


def test_a_tensor_kept_on_the_module_is_never_a_fake_one():
    m = add_tvm_dispatch(KeepsLast(), (torch.randn(3, 4),), verify=False, fallback=True)
    assert m.last is None
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            y = m(x)
            assert type(m.last) is torch.Tensor and torch.equal(m.last, y.detach())


class ScaledByAttributes(torch.nn.Module):
    """Tensors on the module that are neither parameters nor buffers: inputs of the call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.tensor(2.0)
        self.table = {"bias": torch.ones(4)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale + self.table["bias"]


@pytest.mark.parametrize(
    "change",
    ["tensor_reassigned", "tensor_in_place", "dict_entry_replaced", "dict_entry_in_place", "dict_reassigned"],
)
def test_a_tensor_attribute_changed_after_compiling_is_read_by_the_same_variant(change: str) -> None:
    """A tensor kept on the module outside its parameters and buffers was compiled in as a
    constant: first a variant kept running it after the user changed it (silently wrong outputs
    and gradients), then any change compiled a new variant (each eval phase of LeViT). Now it is
    an input of the call: the variant reads the tensor there now, however it was changed."""
    torch.manual_seed(0)
    ref = ScaledByAttributes()
    m = add_tvm_dispatch(copy.deepcopy(ref), (torch.randn(3, 4),), verify=False)
    x = torch.randn(3, 4)
    for mod in (m, ref):
        mod(x).sum().backward()
        if change == "tensor_reassigned":
            mod.scale = torch.tensor(3.0)
        elif change == "tensor_in_place":
            mod.scale.fill_(3.0)
        elif change == "dict_entry_replaced":
            mod.table["bias"] = torch.zeros(4)
        elif change == "dict_entry_in_place":
            mod.table["bias"].fill_(7.0)
        else:
            mod.table = {"bias": torch.full((4,), 5.0)}
        mod.zero_grad()
    for mod in (m, ref):
        mod.out = mod(x)
        mod.out.sum().backward()
    torch.testing.assert_close(m.out, ref.out)
    torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)
    assert len(m._tvm_dispatch.variants) == 1  # no recompile


class GrowingStack(torch.nn.Module):
    """A forward that reads what the module has: its layers, and an optional attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if getattr(self, "gain", None) is not None:
            x = x * self.gain
        if "shift" in self._buffers:
            x = x + self._buffers["shift"]
        return x


def _trusted_then_changed(change) -> torch.nn.Module:
    """A dispatched ``GrowingStack`` trusted (three checked calls), then ``change(module)`` made
    to it and to an eager copy, one step of each compared (outputs and every gradient)."""
    torch.manual_seed(0)
    ref = GrowingStack()
    m = add_tvm_dispatch(copy.deepcopy(ref), (torch.randn(3, 4),))
    x = torch.randn(3, 4)
    for _ in range(3):
        m(x).sum().backward()
    for mod in (m, ref):
        change(mod)
        mod.zero_grad()
        mod.out = mod(x)
        mod.out.sum().backward()
    torch.testing.assert_close(m.out, ref.out)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    return m


@pytest.mark.parametrize("change", ["layer_appended", "attribute_added", "buffer_registered"])
def test_a_name_added_to_the_module_after_compiling_is_not_missed(change: str) -> None:
    """A trusted variant kept running after a layer was appended to a ``ModuleList`` or an
    attribute the forward looks up with a default was set: the guard checked every name the module
    had when compiled, never one added after (silently wrong outputs and gradients)."""
    added = torch.nn.Linear(4, 4)

    def apply(mod: torch.nn.Module) -> None:
        if change == "layer_appended":
            mod.layers.append(copy.deepcopy(added))
        elif change == "attribute_added":
            mod.gain = 3.0
        else:
            mod.register_buffer("shift", torch.full((4,), 0.5))

    m = _trusted_then_changed(apply)
    what = {"layer_appended": "layers.2 (a submodule)", "attribute_added": "gain (an attribute)"}
    assert what.get(change, "shift (a buffer)") in m._tvm_dispatch.variants[-1].why


class Doubled(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@pytest.mark.parametrize("change", ["forward_patched", "class_swapped"])
def test_a_submodule_given_another_forward_after_compiling_runs_it(change: str) -> None:
    """A submodule's forward patched on the instance, or its class swapped (what some adapter
    and quantization tools do), after a variant was trusted: the compiled code is the old forward."""

    def apply(mod: torch.nn.Module) -> None:
        layer = mod.layers[1]
        if change == "forward_patched":
            layer.forward = lambda h, layer=layer: torch.nn.functional.linear(h, layer.weight) * 0.5
        else:
            layer.__class__ = Doubled

    m = _trusted_then_changed(apply)
    assert "layers.1" in m._tvm_dispatch.variants[-1].why


class EvalCache(torch.nn.Module):
    """LeViT's attention biases: in eval mode, a dict filled in place on first use (a trace left a
    fake tensor in it, and the next eager call crashed on it); emptied by ``train()``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bias = torch.nn.Parameter(torch.randn(4))
        self.cache: dict[str, torch.Tensor] = {}

    def train(self, mode: bool = True) -> EvalCache:
        super().train(mode)
        if mode:
            self.cache = {}
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.lin(x) + self.bias * 2
        if "cpu" not in self.cache:
            self.cache["cpu"] = self.bias * 2
        return self.lin(x) + self.cache["cpu"]


def _phases_against_eager(make: type[EvalCache], evals: tuple[int, ...]) -> tuple[torch.nn.Module, list[str]]:
    """Per phase, on a dispatched model and an eager copy: ``train()``, an SGD step, ``eval()``
    and ``n`` no_grad calls, every eval output compared (the cache as trained) and the cache
    never holding a tracer's fake tensor; the dispatched model and the warnings' messages."""
    torch.manual_seed(0)
    ref = make()
    m = add_tvm_dispatch(copy.deepcopy(ref), verify=False)
    opts = [torch.optim.SGD(mod.parameters(), lr=0.5) for mod in (m, ref)]
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in evals:
            outs = []
            for mod, opt in zip((m, ref), opts):
                mod.train()
                mod(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
                mod.eval()
                with torch.no_grad():
                    outs.append([mod(x) for _ in range(n)])
            assert all(type(t) is torch.Tensor for t in m.cache.values())  # never a tracer's fake
            for got, want in zip(*outs):
                torch.testing.assert_close(got, want)
    return m, [str(w.message) for w in caught]


def _count_compile_attempts(monkeypatch) -> list[int]:
    from tvmbridge.runtime.variant_set import VariantSet

    attempts: list[int] = []
    compile_variant = VariantSet.compile_variant
    monkeypatch.setattr(VariantSet, "compile_variant", lambda *a, **k: attempts.append(1) or compile_variant(*a, **k))
    return attempts


def test_a_cache_dict_filled_in_place_in_eval_is_filled_by_pytorch_and_read_by_one_variant(monkeypatch) -> None:
    attempts = _count_compile_attempts(monkeypatch)
    m, messages = _phases_against_eager(EvalCache, (2, 2, 2))
    deferred = [s for s in messages if "compiling deferred" in s]
    assert deferred and "EvalCache.cache" in deferred[0]
    assert any("was emptied" in d for d in deferred)  # PyTorch refills it: no trace, no compile
    assert len(attempts) == 3  # train; eval (deferred, the trace filled the cache), eval
    assert not any("on every call" in s for s in messages)  # not refused for good
    assert [v.label.split(":")[0] for v in m._tvm_dispatch.variants] == ["train", "eval"]  # the cache an input
    assert m._tvm_dispatch.variants[1].calls == 3  # the second call of each eval phase


class EvalCacheClearedInPlace(EvalCache):
    """The same cache emptied with ``clear()``: the dict object stays, its entries go."""

    def train(self, mode: bool = True) -> EvalCacheClearedInPlace:
        torch.nn.Module.train(self, mode)
        if mode:
            self.cache.clear()
        return self


@pytest.mark.parametrize("make", [EvalCache, EvalCacheClearedInPlace], ids=["replaced", "cleared"])
def test_one_eval_call_between_training_phases_runs_pytorch_without_tracing_again(monkeypatch, make) -> None:
    """A validation pass of one batch between epochs: every eval call finds the cache ``train()``
    emptied. Each runs PyTorch (the cache filled as eager fills it) without a trace, never refused
    for good as "assigns on every call"; a later phase of two eval calls compiles the eval variant."""
    attempts = _count_compile_attempts(monkeypatch)
    m, messages = _phases_against_eager(make, (1, 1, 1, 2))
    assert not any("on every call" in s for s in messages)
    assert any("hold again what they held" in s and f"{make.__name__}.cache" in s for s in messages)
    assert "calls: 5 compiled, 4 PyTorch" in m._tvm_dispatch.explain(), m._tvm_dispatch.explain()
    assert len(attempts) == 3  # train; the first eval (deferred); the last phase's second eval call
    assert [v.label.split(":")[0] for v in m._tvm_dispatch.variants] == ["train", "eval"]
    assert m._tvm_dispatch.variants[1].calls == 1


@pytest.mark.parametrize("evals", [(2, 1, 1, 1), (1, 2, 1, 1, 2)], ids=["two_then_one", "mixed"])
def test_eval_phases_of_one_call_after_an_eval_variant_exists_are_never_refused(evals) -> None:
    """The eval variant compiled in a phase of two calls; later phases of one call each find the
    cache emptied, run PyTorch, and the key is never refused as assigning on every call."""
    m, messages = _phases_against_eager(EvalCache, evals)
    assert not any("on every call" in s for s in messages)
    assert not m._tvm_dispatch.failures
    assert f"calls: {len(evals) + sum(n - 1 for n in evals)} compiled" in m._tvm_dispatch.explain()


def test_an_attribute_assigned_anew_each_call_is_still_refused_after_the_deferral() -> None:
    """What separates the two: a counter holds another value after PyTorch's call, an emptied
    cache the value it held before it."""
    m = add_tvm_dispatch(PlainCounter(), verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(torch.randn(3, 4))  # the first trace assigns: PyTorch runs the call
    m.calls = 5  # set from outside between calls: still another value than the trace met first
    with pytest.raises(ConversionError, match="on every call .*PlainCounter.calls"):
        m(torch.randn(3, 4))


class HeldLeaf(torch.nn.Module):
    """A leaf that requires grad kept as a plain attribute (not registered): PyTorch gives it a
    gradient; compiled in as a constant, it had none (silently wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.gain = torch.ones(4, requires_grad=True)
        self.shift = [torch.zeros(4), torch.full((4,), 0.5)]  # entries of a list: inputs too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = getattr(self, "out", None)  # the last output, when the loop stored one: its shape checked
        if last is not None and last.shape[-1] != self.lin.out_features:
            raise ValueError("another width")
        return self.lin(x) * self.gain + self.shift[1]


def test_a_held_leaf_that_requires_grad_gets_its_gradient_and_a_stored_loss_is_data() -> None:
    torch.manual_seed(0)
    ref = HeldLeaf()
    m = add_tvm_dispatch(copy.deepcopy(ref), (torch.randn(3, 4),), verify=False)
    for step in range(3):
        x = torch.randn(3, 4)
        for mod in (m, ref):
            mod.gain.grad = None
            mod.shift[1] = torch.full((4,), float(step))  # a new tensor each step: read, not compiled in
            mod.out = mod(x)  # stored on the module (a tensor with a graph) from the second step on
            mod.out.square().sum().backward()
        torch.testing.assert_close(m.out, ref.out)
        assert m.gain.grad is not None and ref.gain.grad is not None
        torch.testing.assert_close(m.gain.grad, ref.gain.grad)
        torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)
    # the first store added a name the forward looks up (a recompile); after it, the stored
    # output is an input no output depends on, passed detached (its graph was freed by the last backward)
    assert len(m._tvm_dispatch.variants) == 2


class GraphedCache(torch.nn.Module):
    """A held tensor computed from a parameter with grad on: PyTorch backpropagates into it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cached = self.lin.weight.sum(0)  # requires grad, not a leaf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.cached


def test_a_held_tensor_with_a_graph_gets_its_gradient_on_through_that_graph() -> None:
    """PyTorch backpropagates through the held tensor into the graph that made it (here into
    ``lin.weight`` a second time); the compiled backward gives the held tensor's gradient and
    autograd takes it on, as eager's does, graph kept or freed alike."""
    torch.manual_seed(0)
    m, ref = GraphedCache(), GraphedCache()  # a non-leaf attribute: no deepcopy
    ref.lin.load_state_dict(m.lin.state_dict())
    ref.cached = ref.lin.weight.sum(0)  # the copy's own graph, from its own weight
    add_tvm_dispatch(m, (torch.randn(3, 4),))
    for _ in range(2):
        x = torch.randn(3, 4)
        got, want = m(x), ref(x)
        assert is_tvm(got)
        torch.testing.assert_close(got, want)
        (got * x).sum().backward(retain_graph=True)
        (want * x).sum().backward(retain_graph=True)
        torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)
        torch.testing.assert_close(m.lin.bias.grad, ref.lin.bias.grad)
    assert m._tvm_dispatch.calls_tvm == 2


def test_old_style_weight_norm_trains_through_the_weight_its_hook_makes_each_call() -> None:
    """``torch.nn.utils.weight_norm`` deletes ``weight`` as a parameter and sets it before every
    call from ``weight_g`` and ``weight_v`` (a forward pre-hook on the module): the compiled code
    reads it as a tensor kept on the module, and its gradient reaches ``weight_g`` and
    ``weight_v`` through the hook's graph."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of parametrizations
        base = torch.nn.Linear(4, 3)
        ref = torch.nn.utils.weight_norm(clone_module(base))
        m = torch.nn.utils.weight_norm(base)
    add_tvm_dispatch(m, (torch.randn(5, 4),))
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1) for mod in (m, ref)]
    for step in range(3):
        x = torch.randn(5, 4)
        for mod, opt in zip((m, ref), opts):
            opt.zero_grad()
            mod(x).pow(2).sum().backward()
            opt.step()
        for name in ("weight_g", "weight_v", "bias"):
            torch.testing.assert_close(getattr(m, name), getattr(ref, name), msg=f"{name} at step {step}")
    assert m._tvm_dispatch.calls_tvm == 3 and not m._tvm_dispatch.failures


class BranchOnHeld(torch.nn.Module):
    """A held tensor read as a Python value: as an input the export cannot branch on it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.temperature = torch.tensor(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.temperature.item() > 1.0:
            return self.lin(x) / self.temperature
        return self.lin(x)


def test_a_held_tensor_read_as_a_value_is_compiled_in_and_a_new_value_recompiles() -> None:
    torch.manual_seed(0)
    ref = BranchOnHeld()
    m = add_tvm_dispatch(copy.deepcopy(ref), (torch.randn(3, 4),), verify=False)
    assert not m._tvm_dispatch.variants[0].compiled.traced.state.held  # a constant, as before
    x = torch.randn(3, 4)
    torch.testing.assert_close(m(x), ref(x))
    for mod in (m, ref):
        mod.temperature = torch.tensor(0.5)
    torch.testing.assert_close(m(x), ref(x))
    assert len(m._tvm_dispatch.variants) == 2 and "temperature" in m._tvm_dispatch.variants[1].why


def test_lstm_weights_stay_real_after_a_trace():
    """nn.LSTM rebuilds its private weight list from the tensors swapped in for the trace."""
    m = add_tvm_dispatch(torch.nn.LSTM(4, 6, batch_first=True), (torch.randn(2, 3, 4),), verify=False)
    assert all(type(w) is torch.nn.Parameter for w in m._flat_weights)


class Recurrent(torch.nn.Module):
    """A GRU and an LSTM (which hold their parameters again in ``_flat_weights``) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = torch.nn.GRU(4, 6, batch_first=True)
        self.lstm = torch.nn.LSTM(6, 5, batch_first=True)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.gru(x)[0])[0][:, -1])


def test_recurrent_layers_train_with_an_optimizer_on_one_variant() -> None:
    """An optimizer step writes every parameter in place, the ones an RNN also lists in
    ``_flat_weights`` too: still the same variant (it had traced again at every step), and the
    numbers PyTorch's."""
    torch.manual_seed(0)
    m = Recurrent()
    ref = copy.deepcopy(m)
    x, y = torch.randn(4, 5, 4), torch.randint(0, 3, (4,))
    add_tvm_dispatch(m, (x,))
    opts = [torch.optim.AdamW(net.parameters(), lr=1e-2) for net in (m, ref)]
    for _ in range(4):
        for net, opt in zip((m, ref), opts):
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert len(m._tvm_dispatch.variants) == 1, [v.why for v in m._tvm_dispatch.variants]
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_a_recurrent_weight_replaced_after_compiling_is_read() -> None:
    """A parameter assigned anew (nn.LSTM lists the new one in ``_flat_weights``) is no longer the
    one compiled for: the call must read the new weight, as PyTorch does."""
    torch.manual_seed(0)
    m = Recurrent()
    x = torch.randn(4, 5, 4)
    add_tvm_dispatch(m, (x,))
    m(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.lstm.weight_hh_l0 = torch.nn.Parameter(torch.randn_like(m.lstm.weight_hh_l0))
        ref = copy.deepcopy(m)
        torch.testing.assert_close(m(x), ref(x))


class Outputs(torch.nn.Module):
    """Outputs with and without a gradient path from what requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return (
            self.lin(x),
            torch.arange(4.0) * 2,
            x.detach() * 3,
            y * 2,
            (self.lin.weight * 0).detach().sum() + y,
            x * 3,
        )


@pytest.mark.parametrize("via", ["dispatch", "backend"])
def test_outputs_without_a_gradient_path_do_not_require_grad(via):
    """They came back from the compiled autograd Function requiring grad: an output kept across
    steps (ConViT's buffer under torch.compile) then made the next backward run into a freed graph."""
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    want = [o.requires_grad for o in Outputs()(x, y)]
    assert want == [True, False, False, False, False, True]
    m = (
        add_tvm_dispatch(Outputs(), verify=False)
        if via == "dispatch"
        else torch.compile(Outputs(), backend="tvmbridge")
    )
    assert [o.requires_grad for o in m(x, y)] == want
    assert [o.requires_grad for o in m(x.detach(), y)] == [True, False, False, False, False, False]


def test_a_buffer_rebuilt_under_torch_compile_trains():
    torch._dynamo.reset()
    m, ref = Table(), Table()
    ref.load_state_dict(m.state_dict())
    compiled = torch.compile(m, backend="tvmbridge")
    for _ in range(3):
        x = torch.randn(3, 4)
        compiled(x).sum().backward()
        ref(x).sum().backward()
    assert not m.table.requires_grad
    torch.testing.assert_close(m.table, ref.table)
    torch.testing.assert_close(m.lin.weight.grad, ref.lin.weight.grad)


@pytest.mark.parametrize("kind", ["spectral_norm", "weight_norm"])
def test_the_old_norm_hooks_are_refused_with_their_parametrization_which_trains_compiled(kind):
    """``nn.utils.spectral_norm``'s hook sets ``module.weight`` on every call (a GAN's
    discriminator; HiFi-GAN's ``weight_norm``): the error names the parametrization to use."""
    from tvmbridge.errors import AttributeWriteError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # weight_norm's deprecation
        old = add_tvm_dispatch(
            torch.nn.Sequential(getattr(torch.nn.utils, kind)(torch.nn.Linear(4, 4))), (torch.randn(2, 4),)
        )
    with pytest.raises(AttributeWriteError, match=rf"0.weight is set on every call .*parametrizations.{kind}, which"):
        for _ in range(2):
            old(torch.randn(2, 4))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(getattr(torch.nn.utils.parametrizations, kind)(torch.nn.Linear(4, 4)))
    new = add_tvm_dispatch(copy.deepcopy(ref), (torch.randn(2, 4),))
    x = torch.randn(3, 4)
    for m in (new, ref):
        m(x).square().sum().backward()
    for (name, a), b in zip(new.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    for (name, a), b in zip(new.named_buffers(), ref.buffers()):  # spectral norm's power iteration
        torch.testing.assert_close(a, b, msg=name)
    assert new._tvm_dispatch.calls_tvm == 1 and new._tvm_dispatch.calls_fallback == 0


class ClonedScale(torch.nn.Module):
    """A forward that reads a copy of its buffer (``spectral_norm`` clones its vectors so): the
    backward reads the copy, which PyTorch keeps apart from the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.scale.clone()).tanh()


def test_a_buffer_written_between_forward_and_backward_keeps_its_copy_as_the_forward_read_it():
    """The buffer moves before the backward (another call's update, an EMA step): PyTorch's
    backward reads the copy the forward made; TVM folded the copy into the buffer, so the compiled
    backward read the buffer itself and failed the version check."""
    torch.manual_seed(0)
    ref = ClonedScale()
    m = add_tvm_dispatch(copy.deepcopy(ref), (torch.randn(3, 4),), verify=False)
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for model in (m, ref):
        y = model(x)
        with torch.no_grad():
            model.scale.mul_(3.0)
        grads.append(torch.autograd.grad(y.sum(), [x, *model.parameters()]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert m._tvm_dispatch.calls_tvm == 1


class ReturnsItsState(torch.nn.Module):
    """Returns buffers it writes (the last batch's features, a sum kept with ``out=``) and an
    input and a parameter as they are: PyTorch returns those very tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("last", torch.zeros(3, 4))
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor, tag: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.fc(x)
        self.last.copy_(h.detach())
        torch.add(self.total, h.detach().sum(0), out=self.total)
        return h.sigmoid(), self.last, self.total, tag, self.fc.bias


@pytest.mark.parametrize("via", ["dispatch", "backend"])
def test_an_output_that_is_an_input_is_that_input(via):
    """What the user keeps of a call's outputs moves with the state as in PyTorch: the returned
    buffers are the module's (after the next call they hold its values), the returned input and
    parameter are the caller's. The compiled code returned fresh copies: a kept ``last`` stayed
    at the first call's values."""
    torch.manual_seed(0)
    ref = ReturnsItsState()
    m = copy.deepcopy(ref)
    x, tag = torch.randn(3, 4), torch.randn(2)
    if via == "backend":
        torch._dynamo.reset()
        run = torch.compile(m, backend="tvmbridge")
    else:
        run = add_tvm_dispatch(m, (x, tag), verify=False)
    for model, module in ((run, m), (ref, ref)):
        y, last, total, same_tag, bias = model(x, tag)
        assert last is module.last and total is module.total and same_tag is tag and bias is module.fc.bias
        model(x * 2, tag)  # the kept outputs now hold the second call's state
        (y.sum() + bias.sum()).backward()
    torch.testing.assert_close(m.last, ref.last)
    torch.testing.assert_close(m.total, ref.total)
    for (name, a), b in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_attribute_states_compare_an_emptied_cache_equal_and_a_counter_or_hook_not() -> None:
    from tvmbridge.frontend.call_state import attribute_states

    m = torch.nn.Sequential(EvalCache())
    labels = ["0.cache"]
    empty = attribute_states(m, labels)
    m[0].cache["cpu"] = torch.ones(4)
    assert attribute_states(m, labels) != empty  # filled
    m[0].train()  # a new empty dict
    assert attribute_states(m, labels) == empty
    m[0].calls = 1
    one = attribute_states(m, ["0.calls"])
    m[0].calls = 2
    assert attribute_states(m, ["0.calls"]) != one
    assert attribute_states(m, ["0 forward hooks"]) is None  # a hook, not an attribute: not compared
    assert attribute_states(m, ["Sequential.training"]) == attribute_states(m, ["Sequential.training"])
