"""Everyday training code against PyTorch: what users do between steps, on zoo models.

Each scenario runs twice from the same weights, once on a model with ``add_tvm_dispatch``
(default options: the first-call net on) and once on an eager deep copy, under the same seeds:
every loss, every gradient at every step and the final parameters are compared, and the bridge's
compiled and PyTorch call counts and its warnings are reported. A scenario the model lacks (an
attribute, an input) fails in eager too and is reported as not applicable.

    python scripts/everyday.py                                  # bert-cls, every scenario
    python scripts/everyday.py --models llama,resnet --scenarios to_double,batch_sizes
    python scripts/everyday.py --via backend                    # torch.compile(model, backend=...) instead

Verdicts: ``OK`` (losses and gradients within ``--rtol`` of eager relative to each tensor's largest
value, or 1e-3 of the scenario's largest where that is more; parameters within ``--param-atol``),
``DIFF`` (further: a bug; a bfloat16 scenario is judged by each run's distance to its float32
twin: the bridge's at most twice eager's), ``RAISED`` (the
bridge raised where eager did not), ``N/A`` (eager raises too: the model lacks what it uses).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvmbridge import add_tvm_dispatch, compile_backend  # noqa: E402
from tvmbridge.dynamo.backend import Backend  # noqa: E402
from tvmbridge.tools.zoo.models import ZooEntry, get  # noqa: E402

Record = list  # losses and gradients in order, then "params", then the final parameters
Scenario = Callable[[ZooEntry, torch.nn.Module, torch.optim.Optimizer, Record], None]
SCENARIOS: dict[str, Scenario] = {}
LOW_PRECISION_SLACK = 2.0  # a bfloat16 run may be this many times further from float32 than eager's


def scenario(f: Scenario) -> Scenario:
    SCENARIOS[f.__name__] = f
    return f


def _batch(e: ZooEntry, b: int = 4, n: int = 16, seed: int = 0) -> dict:
    return dict(e.make_batch(b, n, seed))


def _grads(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.parameters() if p.grad is not None]


def _step(e: ZooEntry, m: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict, seed: int, rec: Record) -> None:
    """One step as a training loop writes it: forward, backward, clipping, AdamW."""
    torch.manual_seed(seed)
    _, loss = e.forward(m, batch)
    loss.backward()
    rec += [loss.detach().clone(), *_grads(m)]
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def _layers(m: torch.nn.Module, kinds: tuple = (torch.nn.Linear, torch.nn.Conv2d)) -> list[torch.nn.Module]:
    return [x for x in m.modules() if isinstance(x, kinds)]


@scenario
def freeze_mid(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    for p in m.get_input_embeddings().parameters():
        p.requires_grad_(False)
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


@scenario
def param_replace(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    head = _layers(m, (torch.nn.Linear,))[-1]
    head.weight = torch.nn.Parameter(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.02)
    _step(e, m, torch.optim.AdamW(m.parameters(), lr=1e-3), _batch(e, seed=1), 2, rec)


@scenario
def load_state(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    torch.manual_seed(9)
    getattr(m, "_orig_mod", m).load_state_dict(e.build().state_dict())  # torch.compile's wrapper: its own keys
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


@scenario
def dropout_p(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    for x in m.modules():
        if isinstance(x, torch.nn.Dropout):
            x.p = 0.3
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


@scenario
def eval_between(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    m.eval()
    with torch.no_grad():
        rec.append(e.forward(m, _batch(e, seed=5))[1])
    rec.append(e.forward(m, _batch(e, seed=5))[1].detach())
    m.train()
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


@scenario
def accumulate(e, m, opt, rec):
    for s in range(2):
        for k in range(2):
            torch.manual_seed(10 * s + k)
            _, loss = e.forward(m, _batch(e, seed=10 * s + k))
            (loss / 2).backward()
            rec.append(loss.detach())
        rec += _grads(m)
        opt.step()
        opt.zero_grad(set_to_none=False)


@scenario
def double_backward(e, m, opt, rec):
    torch.manual_seed(1)
    _, loss = e.forward(m, _batch(e))
    params = [p for p in m.parameters() if p.requires_grad]
    penalty = sum((g**2).sum() for g in torch.autograd.grad(loss, params, create_graph=True))
    (loss + penalty).backward()
    rec += [penalty.detach(), *_grads(m)]


@scenario
def to_double(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    m.double()
    wide = {k: v.double() if v.is_floating_point() else v for k, v in _batch(e, seed=1).items()}
    _step(e, m, torch.optim.AdamW(m.parameters(), lr=1e-3), wide, 2, rec)


@scenario
def hook_after(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    _layers(m)[1].register_forward_hook(lambda mod, i, o: o * 2)
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


@scenario
def batch_sizes(e, m, opt, rec):
    for i, b in enumerate([4, 1, 3, 4, 2]):
        _step(e, m, opt, _batch(e, b=b, seed=i), i, rec)


@scenario
def kwargs_change(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    torch.manual_seed(2)
    out = m(**_batch(e, seed=1), output_hidden_states=True)
    (out.loss + out.hidden_states[-1].pow(2).mean()).backward()
    rec += [out.loss.detach(), *_grads(m)]


@scenario
def inference_mode(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    with torch.inference_mode():
        rec.append(e.forward(m, _batch(e, seed=3))[1].clone())
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


def _autocast_later(e, m, opt, rec, enabled: bool = True):
    _step(e, m, opt, _batch(e), 1, rec)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        torch.manual_seed(2)
        _, loss = e.forward(m, _batch(e, seed=1))
    loss.backward()
    rec += [loss.detach().float(), *_grads(m)]


@scenario
def autocast_later(e, m, opt, rec):
    _autocast_later(e, m, opt, rec)


# a bfloat16 scenario's float32 twin: both runs are judged by their distance to it (eager's own
# bfloat16 rounding sets the bar), not against each other: two roundings of one value differ by
# twice what either is off
FLOAT32_TWIN: dict[str, Scenario] = {"autocast_later": lambda e, m, opt, rec: _autocast_later(e, m, opt, rec, False)}


@scenario
def functional_call(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    params = {n: p.detach() * 1.01 for n, p in m.named_parameters()}
    torch.manual_seed(3)
    rec.append(e.forward(_Functional(m, params), _batch(e, seed=1))[1].detach())
    _step(e, m, opt, _batch(e, seed=2), 2, rec)


class _Functional(torch.nn.Module):
    """``torch.func.functional_call`` of a module with other parameters, as a callable module."""

    def __init__(self, module: torch.nn.Module, params: dict) -> None:
        super().__init__()
        self.inner, self.params = [module], params

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.inner[0], self.params, args, kwargs)


@scenario
def no_grad_first(e, m, opt, rec):
    with torch.no_grad():
        torch.manual_seed(0)
        rec.append(e.forward(m, _batch(e))[1])
    _step(e, m, opt, _batch(e), 1, rec)


@scenario
def input_gradient(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    for p in m.parameters():
        p.requires_grad_(False)
    batch = _batch(e, seed=1)
    x = m.get_input_embeddings()(batch.pop("input_ids")).detach().requires_grad_(True)
    torch.manual_seed(4)
    out = m(inputs_embeds=x, **batch)
    out.loss.backward()
    rec += [out.loss.detach(), x.grad.clone()]


@scenario
def embeds_outside(e, m, opt, rec):
    """The caller embeds (prompt tuning, FreeLB's adversarial steps): the embedding's weight, tied
    to the head, reaches the loss through the call's input and inside it."""
    for seed in (1, 2):
        batch = _batch(e, seed=seed)
        torch.manual_seed(seed)
        emb = m.get_input_embeddings()(batch.pop("input_ids"))
        out = m(inputs_embeds=emb + 0.01 * torch.randn_like(emb), **batch)
        out.loss.backward()
        rec += [out.loss.detach(), *_grads(m)]
        opt.step()
        opt.zero_grad()


@scenario
def seq_lengths(e, m, opt, rec):
    for i, n in enumerate([16, 9, 23, 16, 5]):  # a loader padding each batch to its longest row
        _step(e, m, opt, _batch(e, n=n, seed=i), i, rec)


def _strided(t: Any) -> Any:
    """The same values as a non-contiguous view (a batch sliced out of a wider tensor)."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return t
    return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]


@scenario
def strided_inputs(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    _step(e, m, opt, {k: _strided(v) for k, v in _batch(e, seed=1).items()}, 2, rec)


@scenario
def step_counter(e, m, opt, rec):
    for i in range(5):  # a training loop keeping its step on the model (forward never reads it)
        m.global_step = i
        _step(e, m, opt, _batch(e, seed=i), i, rec)


@scenario
def adapter_after(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    parent, name, layer = next(
        (p, n, c) for p in m.modules() for n, c in p.named_children() if isinstance(c, torch.nn.Linear)
    )
    setattr(parent, name, _Adapter(layer))  # a LoRA-style adapter put in after compiling
    _step(e, m, torch.optim.AdamW(m.parameters(), lr=1e-3), _batch(e, seed=1), 2, rec)


class _Adapter(torch.nn.Module):
    """``layer(x) + up(down(x))``, the low-rank update LoRA adds, ``up`` nonzero so it shows."""

    def __init__(self, layer: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.layer = layer
        self.down = torch.nn.Parameter(torch.randn(rank, layer.in_features, generator=g) * 0.1)
        self.up = torch.nn.Parameter(torch.randn(layer.out_features, rank, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) + x @ self.down.t() @ self.up.t()


@scenario
def grad_hooks(e, m, opt, rec):
    for i, p in enumerate(m.parameters()):  # per-parameter gradient hooks, one scaling by half
        p.register_hook(lambda g, i=i: g * 0.5 if i % 2 else g)
    seen: list[torch.Tensor] = []
    next(m.parameters()).register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    _step(e, m, opt, _batch(e), 1, rec)
    _step(e, m, opt, _batch(e, seed=1), 2, rec)
    rec += seen


@scenario
def anomaly_mode(e, m, opt, rec):
    with torch.autograd.detect_anomaly(check_nan=True):
        _step(e, m, opt, _batch(e), 1, rec)
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


@scenario
def ema_copy(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    ema = copy.deepcopy(m).eval()  # timm's ModelEmaV2: a deep copy of the training model, updated in place
    for i in range(2):
        _step(e, m, opt, _batch(e, seed=i + 1), i + 2, rec)
        with torch.no_grad():
            for a, b in zip(ema.parameters(), m.parameters()):
                a.lerp_(b, 0.5)
            rec.append(e.forward(ema, _batch(e, seed=7))[1])


@scenario
def prune_after(e, m, opt, rec):
    import torch.nn.utils.prune as prune

    _step(e, m, opt, _batch(e), 1, rec)
    layer = _layers(m, (torch.nn.Linear,))[0]
    prune.l1_unstructured(layer, "weight", amount=0.5)  # weight becomes weight_orig * mask, by a pre-hook
    _step(e, m, torch.optim.AdamW(m.parameters(), lr=1e-3), _batch(e, seed=1), 2, rec)


@scenario
def weight_norm_after(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    layer = _layers(m, (torch.nn.Linear,))[0]
    torch.nn.utils.parametrizations.weight_norm(layer)  # the module's class is swapped for a parametrized one
    _step(e, m, torch.optim.AdamW(m.parameters(), lr=1e-3), _batch(e, seed=1), 2, rec)


@scenario
def submodule_eval(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    for x in m.modules():  # dropout and normalization statistics frozen, the rest training
        if isinstance(x, (torch.nn.Dropout, torch.nn.modules.batchnorm._BatchNorm)):
            x.eval()
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


@scenario
def checkpointing_after(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    m.gradient_checkpointing_enable()  # transformers' activation checkpointing, turned on mid-run
    _step(e, m, opt, _batch(e, seed=1), 2, rec)


@scenario
def config_after(e, m, opt, rec):
    _step(e, m, opt, _batch(e), 1, rec)
    m.config.output_hidden_states = True  # the config object changed after compiling
    out, loss = e.forward(m, _batch(e, seed=1))
    rec.append(loss.detach())
    hidden = getattr(out, "hidden_states", None)
    rec.append(torch.tensor(float(len(hidden) if hidden is not None else -1)))


def _run(e: ZooEntry, model: torch.nn.Module, name: str, scenario: Scenario | None = None) -> tuple[Record, str | None]:
    rec: Record = []
    try:
        (scenario or SCENARIOS[name])(e, model, torch.optim.AdamW(model.parameters(), lr=1e-3), rec)
    except Exception as exc:  # noqa: BLE001 - reported
        return rec, f"{type(exc).__name__}: {str(exc)[:200]}"
    return [*rec, "params", *(p.detach().clone() for p in model.parameters())], None


def _relative(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """|a - b| relative to b's largest value, but never to less than ``floor``: a gradient that is
    zero in exact arithmetic (a key bias under softmax) holds rounding residue only."""
    if not a.numel():
        return 0.0
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), floor, 1e-30)


def judge(got: Record, want: Record, rtol: float, param_atol: float) -> tuple[str, str]:
    """(verdict, detail) of a scenario's two records."""
    if len(got) != len(want) or any(type(a) is not type(b) for a, b in zip(got, want)):
        return "DIFF", f"{len(got)} records vs eager's {len(want)}"
    cut = got.index("params")
    floor = 1e-3 * max((float(b.double().abs().max()) for b in want[:cut] if b.numel()), default=0.0)
    worst = max((_relative(a, b, floor) for a, b in zip(got[:cut], want[:cut])), default=0.0)
    params = max(((a - b).abs().max().item() for a, b in zip(got[cut + 1 :], want[cut + 1 :]) if a.numel()), default=0)
    verdict = "OK" if worst <= rtol and params <= param_atol else "DIFF"
    return verdict, f"losses/gradients within {worst:.1e}, parameters within {params:.1e}"


def judge_low_precision(got: Record, want: Record, exact: Record, rtol: float) -> tuple[str, str]:
    """(verdict, detail) of a bfloat16 scenario: each loss and gradient of the bridge's run at most
    :data:`LOW_PRECISION_SLACK` times as far from the float32 twin's as eager's is (or ``rtol``)."""
    cut = got.index("params") if "params" in got else len(got)
    if len(got) != len(want) or len(exact) != len(want):
        return "DIFF", f"{len(got)} records vs eager's {len(want)} and float32's {len(exact)}"
    floor = 1e-3 * max((float(b.double().abs().max()) for b in exact[:cut] if b.numel()), default=0.0)
    ours = [_relative(a, b, floor) for a, b in zip(got[:cut], exact[:cut])]
    theirs = [_relative(a, b, floor) for a, b in zip(want[:cut], exact[:cut])]
    ok = all(o <= max(LOW_PRECISION_SLACK * t, rtol) for o, t in zip(ours, theirs))
    return ("OK" if ok else "DIFF"), f"from float32: bridge within {max(ours):.1e}, eager within {max(theirs):.1e}"


def _calls(model: torch.nn.Module, backend: Backend | None) -> str:
    """How many calls ran compiled and how many PyTorch (summed over the backend's graphs)."""
    if backend is None:
        log = model._tvm_dispatch.log
        return f"compiled {log.calls_tvm}, PyTorch {log.calls_fallback}"
    logs = [g.dispatcher.log for g in backend.graphs]
    tvm, eager = sum(g.calls_tvm for g in logs), sum(g.calls_fallback for g in logs)
    return f"{len(logs)} graphs: compiled {tvm}, PyTorch {eager}; {len(backend.refused)} graphs refused"


def run_scenario(model_name: str, name: str, rtol: float, param_atol: float, via: str = "dispatch") -> str:
    e = get(model_name)
    torch.manual_seed(0)
    model = e.build().train()
    ref = copy.deepcopy(model)
    twin = copy.deepcopy(model) if name in FLOAT32_TWIN else None  # its float32 steps, for a bfloat16 scenario
    backend = None
    if via == "backend":  # as a user of torch.compile writes it: the compiled wrapper is what trains
        torch._dynamo.reset()
        backend = compile_backend()
        tvm: torch.nn.Module = torch.compile(model, backend=backend)  # type: ignore[assignment]
    else:
        tvm = add_tvm_dispatch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, error = _run(e, tvm, name)
    want, eager_error = _run(e, ref, name)
    calls = _calls(model, backend)
    said = sorted({str(w.message).split("\n")[0][:150] for w in caught if "tvmbridge" in str(w.message)})
    if eager_error is not None:
        return f"{model_name:12s} {name:16s} N/A     eager raises {eager_error[:100]}"
    if error is not None:
        return f"{model_name:12s} {name:16s} RAISED  {error} | {calls}"
    if twin is not None:
        exact, _ = _run(e, twin, name, FLOAT32_TWIN[name])
        verdict, detail = judge_low_precision(got, want, exact, rtol)
    else:
        verdict, detail = judge(got, want, rtol, param_atol)
    return f"{model_name:12s} {name:16s} {verdict:7s} {detail} | {calls} | {said}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert-cls")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--param-atol", type=float, default=2e-4, help="two AdamW steps of lr 1e-3 on noise-level signs")
    ap.add_argument("--via", choices=("dispatch", "backend"), default="dispatch",
                    help="add_tvm_dispatch (default) or torch.compile(model, backend=tvmbridge.compile_backend())")
    args = ap.parse_args(argv)
    verdicts = []
    for model_name in args.models.split(","):
        for name in args.scenarios.split(","):
            line = run_scenario(model_name, name, args.rtol, args.param_atol, args.via)
            verdicts.append(line.split()[2])
            print(line, flush=True)
    print({v: verdicts.count(v) for v in sorted(set(verdicts))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
