"""One zoo case: train a model a few steps through the bridge beside PyTorch and judge the result.

Three copies of the same model run every step under the same seed (so that dropout draws the
same masks): ``eager`` (PyTorch, float32), ``tvm`` (the bridge, dispatched at the top without a
sample, as users commonly do: the first call compiles) and ``ref`` (PyTorch in float64). The
distance eager-ref is the float noise of the step; the bridge passes a tensor when its distance
to eager is within ten times that noise (plus 1e-6 of the tensor's scale), so that a tolerance
never hides a real error and float reassociation never fails a model. Where a tensor is outside
that, the noise is the larger of eager-ref and eager's own distance to the step rerun from
parameters one rounding away (:class:`RoundingSpread`: a chaotic call moves that far by rounding).

Verdicts: EXACT (every tensor within noise, every call compiled), FALLBACK (numbers right, some
call ran PyTorch), REFUSED (a ``ConversionError``: the bridge said clearly what it cannot do),
WRONG (a tensor outside noise), CRASH (any other exception), SKIP (PyTorch itself failed: a bug
of the zoo entry, to be fixed there).

    python -m tvmbridge.tools.zoo.harness bert-mlm          # one case in this process, JSON out
    python -m tvmbridge.tools.zoo.harness bert-mlm --via backend   # through torch.compile instead

``--via backend``: the ``tvm`` copy is ``torch.compile(model, backend=compile_backend(...))``
(a graph the bridge cannot convert runs PyTorch with a warning: FALLBACK).

``--autocast``: ``eager`` and ``tvm`` run every call (and the timed steps) under
``torch.autocast(dtype=bfloat16)``, float32 master weights, as mixed-precision training does;
``ref`` stays float64 without autocast. The noise is then eager autocast's own distance to float64,
so TVM passes where it is as close to the full-precision step as eager autocast is (ten times).

    python -m tvmbridge.tools.zoo.harness bert-mlm --autocast
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .compare import AUTOCAST_SCALE_TOL, SCALE_TOL, Mismatch, measure, named_leaves
from .models import Batch, ZooEntry, get

BUILD_SEED = 0
CALL_SEED = 123
FIRST = (2, 16)  # (batch, length) of steps 1 and 2
SECOND = (3, 11)  # of step 3: another batch size and length (images: another batch size)
ROLES = ("eager", "tvm", "ref")
AFTER_STEP = " after AdamW"  # the suffix of a step's parameter comparison
LR = 1e-3  # AdamW's learning rate
SPREAD_SEED = 7
ROUNDING = 2.0**-23  # one float32 step at 1: how far RoundingSpread moves each parameter, relative


@dataclass
class CaseResult:
    """Everything one case found; JSON-able (``asdict``) for the subprocess that runs it."""

    name: str
    family: str
    verdict: str = "CRASH"
    reason: str = ""
    worst: dict | None = None  # the first failing step's worst tensor (a Mismatch as a dict)
    failures: list[dict] = field(default_factory=list)  # worst tensor and count of each failing step
    fallbacks: list[str] = field(default_factory=list)
    compile_s: float = 0.0
    variants: int = 0
    variant_why: list[str] = field(default_factory=list)
    symbolic: bool | None = None  # whether the step-3 call (another batch and length) ran a symbolic variant
    tvm_ms: float | None = None
    eager_ms: float | None = None
    ratio: float | None = None
    wall_s: float = 0.0
    closest: str = ""  # the passing tensor nearest its tolerance: "err/tol at step: tensor"
    note: str = ""


class _StepError(Exception):
    """An exception of one role's call, with where it happened."""

    def __init__(self, role: str, where: str, exc: BaseException) -> None:
        super().__init__(f"{role} {where}")
        self.role, self.where, self.exc = role, where, exc


# --- tensors ----------------------------------------------------------------------------------
def to_device(batch: Batch, device: str) -> Batch:
    """The batch's tensors on ``device`` (the zoo's batches are made on the CPU, seeded)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def to_reference(batch: Batch) -> Batch:
    """The batch for the float64 reference: float tensors in float64."""
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


# --- the case ---------------------------------------------------------------------------------
class Case:
    """The three models, their optimizers, and the steps of the protocol."""

    def __init__(
        self,
        entry: ZooEntry,
        options: dict[str, Any],
        via: str = "dispatch",
        device: str = "cpu",
        autocast: bool = False,
    ) -> None:
        from tvmbridge import add_tvm_dispatch, compile_backend

        self.entry = entry
        self.device = torch.device(device)
        self.autocast = autocast
        self.backend = None
        self.mismatches: list[list[Mismatch]] = []
        self.step3_variant: Any = None
        self.closest: tuple[float, str] = (0.0, "")  # the passing tensor nearest its tolerance
        torch.manual_seed(BUILD_SEED)
        with self.guard("eager", "build"):
            eager = entry.build().train().to(self.device)
        with self.guard("eager", "deepcopy"):
            tvm = copy.deepcopy(eager)
            ref = copy.deepcopy(eager).double()
            if entry.prepare_reference is not None:
                entry.prepare_reference(ref)
        self.models = {"eager": eager, "tvm": tvm, "ref": ref}
        self.callables: dict[str, Any] = dict(self.models)  # what each role calls
        if via == "backend":
            torch._dynamo.reset()
            self.backend = compile_backend(**options)
            self.callables["tvm"] = torch.compile(tvm, backend=self.backend)
        else:
            with self.guard("tvm", "add_tvm_dispatch"):
                add_tvm_dispatch(tvm, **options)
        self.optimizers = {role: torch.optim.AdamW(m.parameters(), lr=LR) for role, m in self.models.items()}

    @contextmanager
    def guard(self, role: str, where: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - every failure is classified, none escapes
            raise _StepError(role, where, exc) from exc

    def precision(self, role: str) -> AbstractContextManager[Any]:
        """The role's numerics: bfloat16 autocast for eager and tvm under ``autocast``; the
        float64 reference never."""
        if not self.autocast or role == "ref":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    @property
    def dispatcher(self) -> Any:
        return getattr(self.models["tvm"], "_tvm_dispatch", None)

    def dispatchers(self) -> list[Any]:
        """The dispatcher of the model and of each submodule dispatched by itself (after a failed
        compile under ``fallback``), or of each graph the backend compiled."""
        if self.backend is not None:
            return [g.dispatcher for g in self.backend.graphs]
        found = (getattr(m, "_tvm_dispatch", None) for m in self.models["tvm"].modules())
        return [d for d in found if d is not None]

    def call(self, role: str, batch: Batch, where: str, backward: bool) -> dict[str, torch.Tensor | None]:
        """One seeded call (and backward); the tensors to compare: loss, outputs, grads, buffers."""
        model = self.models[role]
        with self.guard(role, where):
            torch.manual_seed(CALL_SEED)
            with self.precision(role):
                out, loss = self.entry.forward(self.callables[role], to_reference(batch) if role == "ref" else batch)
            if backward:
                loss.backward()
        got: dict[str, torch.Tensor | None] = {"loss": loss.detach() if isinstance(loss, torch.Tensor) else None}
        got.update({k: v.detach().clone() for k, v in named_leaves(out).items()})
        if backward:
            got.update(
                {f"grad:{n}": None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
            )
        got.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
        return got

    def check(
        self,
        step: str,
        got: Mapping[str, Mapping[str, torch.Tensor | None]],
        allowance: float = 0.0,
        spread: RoundingSpread | None = None,
    ) -> None:
        names = list(dict.fromkeys([*got["eager"], *got["tvm"]]))
        found = []
        for name in names:
            if name in got["eager"] and name not in got["tvm"]:
                found.append(Mismatch(step, name, math.inf, 0, 0, "missing from TVM's output"))
            elif name not in got["eager"]:
                found.append(Mismatch(step, name, math.inf, 0, 0, "in TVM's output only"))
            else:
                m = measure(step, name, got["tvm"][name], got["eager"][name], got["ref"].get(name))
                scale_tol = AUTOCAST_SCALE_TOL if self.autocast else SCALE_TOL
                m = dataclasses.replace(m, allowance=allowance, scale_tol=scale_tol)
                if not m.passed and spread is not None:
                    m = dataclasses.replace(m, spread=spread.distance(name, got["eager"][name]))
                if not m.passed:
                    found.append(m)
                elif m.excess > self.closest[0]:
                    self.closest = (m.excess, f"{step}: {name}")
        if found:
            self.mismatches.append(found)

    def train_step(self, step: str, batch: Batch) -> None:
        """Call, backward, compare; clip, AdamW, compare parameters; then sync to eager's."""
        got = {}
        spread = RoundingSpread(self, batch)  # before the calls: it starts from the same state
        for role in ROLES:
            got[role] = self.call(role, batch, f"{step} forward/backward", backward=True)
            if role == "tvm" and step == "step 3":
                self.step3_variant = [getattr(d, "last_decision", None) for d in self.dispatchers()]
        self.check(step, got, spread=spread)
        params, clipped = {}, {}
        for role, model in self.models.items():
            with self.guard(role, f"{step} AdamW"):
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
                clipped[role] = {f"clipped grad:{n}": _clone(p.grad) for n, p in model.named_parameters()}
                self.optimizers[role].step()
                self.optimizers[role].zero_grad(set_to_none=True)
            params[role] = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
        self.check(f"{step} clipped", clipped, spread=spread)  # gradients sharing memory would be scaled twice
        # AdamW's first update is about lr * sign(grad) per element: a gradient element at noise
        # level may take the other sign, moving the parameter by up to 2 lr where PyTorch's did not
        self.check(f"{step}{AFTER_STEP}", params, allowance=2 * LR)
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """eager's parameters and buffers into tvm and ref, so noise does not accumulate."""
        eager = self.models["eager"]
        state = {**dict(eager.named_parameters()), **dict(eager.named_buffers())}
        for role in ("tvm", "ref"):
            model = self.models[role]
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                t.copy_(state[name])

    def eval_step(self, batch: Batch, where: str = "eval") -> None:
        """An eval phase: ``train()`` first where the model was trained since (a user's loop:
        LeViT's ``train()`` empties the cache its eval mode fills), then ``eval()``, no_grad."""
        got = {}
        spread = RoundingSpread(self, batch, backward=False)
        for role, model in self.models.items():
            model.train()
            model.eval()
            with torch.no_grad():
                got[role] = self.call(role, batch, f"{where} forward", backward=False)
        self.check(where, got, spread=spread)

    def variant_count(self) -> int:
        return sum(len(d.variants) for d in self.dispatchers())

    def time_steps(self, batch: Batch, runs: int = 3) -> tuple[float, float]:
        """Median ms of a train step (forward, loss, backward, AdamW), TVM and eager interleaved."""
        from tvmbridge.tools.timing import interleaved

        def step(role: str):
            model, opt = self.callables[role], self.optimizers[role]

            def run(i: int) -> None:
                torch.manual_seed(CALL_SEED)
                with self.precision(role):
                    _, loss = self.entry.forward(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the step's kernels inside its time

            return run

        for model in self.models.values():
            model.train()
        times = interleaved({"tvm": step("tvm"), "eager": step("eager")}, runs=runs, warmup=1)
        return 1e3 * statistics.median(times["tvm"]), 1e3 * statistics.median(times["eager"])


class RoundingSpread:
    """PyTorch's own call again, from parameters moved by one float32 rounding (seeded): how far
    rounding alone moves each tensor of the step. In a chaotic call (BatchNorm over a batch of
    two, ReLU gates near zero) eager's one distance to float64 undersells the noise, and an exact
    bridge was judged WRONG (timm skresnet18, mixnet_s: compiled in float64 they match PyTorch's
    float64 to 1e-12). The safety net judges its calls the same way (``runtime/verify.py``). Run
    only for a step with a tensor outside noise; the noise is then the larger of the two."""

    def __init__(self, case: Case, batch: Batch, backward: bool = True) -> None:
        self.case, self.batch, self.backward = case, batch, backward
        eager = case.models["eager"]
        self.state = {n: t.detach().clone() for n, t in [*eager.named_parameters(), *eager.named_buffers()]}
        self.got: dict[str, torch.Tensor | None] | None = None

    def distance(self, name: str, eager: torch.Tensor | None) -> float:
        """max|eager' - eager| of tensor ``name`` (0 where it cannot be measured)."""
        if self.got is None:
            self.got = self._run()
        other = self.got.get(name)
        if other is None or eager is None or other.shape != eager.shape or not eager.is_floating_point():
            return 0.0
        d = other.double() - eager.double()
        finite = torch.isfinite(d)
        return d[finite].abs().max().item() if finite.any() else 0.0

    def _run(self) -> dict[str, torch.Tensor | None]:
        case = self.case
        moved = copy.deepcopy(case.models["eager"])
        gen = torch.Generator().manual_seed(SPREAD_SEED)
        with torch.no_grad():
            for n, t in [*moved.named_parameters(), *moved.named_buffers()]:
                t.copy_(self.state[n])  # as before the step's calls (buffers too; no load_state_dict hooks)
            for p in moved.parameters():
                p.grad = None
                if p.is_floating_point():
                    p.mul_(1 + ROUNDING * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
        case.models["moved"] = case.callables["moved"] = moved
        try:
            with torch.set_grad_enabled(self.backward):
                got = case.call("moved", self.batch, "rounding spread", backward=self.backward)
            if self.backward:
                torch.nn.utils.clip_grad_norm_(list(moved.parameters()), 1.0)
                got.update({f"clipped grad:{n}": _clone(p.grad) for n, p in moved.named_parameters()})
            return got
        except _StepError:
            return {}  # no spread: the judgement stands as it was
        finally:
            del case.models["moved"], case.callables["moved"]


def _judge_mismatches(result: CaseResult, case: Case) -> None:
    """A case with mismatches is WRONG (whatever happened after them): the worst tensor per step."""
    per_step = [max(found, key=lambda m: m.excess) for found in case.mismatches]
    result.failures = [dict(asdict(m), count=len(found)) for m, found in zip(per_step, case.mismatches)]
    result.worst = asdict(per_step[0])
    wrong = f"{per_step[0].text()} ({len(case.mismatches[0])} tensors)"
    result.reason = wrong + (f"; then {result.verdict}: {result.reason}" if result.verdict != "EXACT" else "")
    result.verdict = "WRONG" if result.verdict in ("EXACT", "CRASH", "REFUSED") else result.verdict


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _where(exc: BaseException) -> str:
    """The innermost frame inside tvmbridge (else the innermost) as ``file:line in fn``."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/tvmbridge/" in f.filename and "/tools/zoo/" not in f.filename]
    picked = ours or frames
    if not picked:
        return "?"
    frame = picked[-1]
    path = frame.filename.split("/tvmbridge/", 1)[-1] if ours else frame.filename.rsplit("/", 1)[-1]
    return f"{path}:{frame.lineno} in {frame.name}"


def _first_line(exc: BaseException) -> str:
    from tvmbridge.errors import describe

    return describe(exc)[:400]


def compile_options(verify: bool | None, fallback: bool = False) -> tuple[dict[str, Any], str]:
    """The options for ``add_tvm_dispatch``: ``verify`` where CompileOptions has the field;
    ``fallback`` (a module that cannot compile whole runs its submodules on TVM) where asked."""
    from tvmbridge import CompileOptions

    options: dict[str, Any] = {"fallback": True} if fallback else {}
    if verify is None or "verify" in CompileOptions.__dataclass_fields__:
        return options | ({} if verify is None else {"verify": verify}), ""
    return options, "" if verify is False else "CompileOptions has no field verify: not passed"


def run_case(
    entry: ZooEntry | str,
    *,
    verify: bool | None = None,
    timing: bool = True,
    via: str = "dispatch",
    device: str = "cpu",
    autocast: bool = False,
    fallback: bool = False,
) -> CaseResult:
    """Run the protocol on one entry (module docstring); never raises for the model's failures.

    ``verify``: passed as ``CompileOptions.verify`` when not None and the field exists (the
    zoo's own runs pass False: the raw state of the bridge). ``device``: where all three copies
    and the batches live (``"cuda"``: the bridge's CUDA build against PyTorch on the same GPU).
    ``autocast``: bfloat16 mixed precision (module docstring). ``fallback``: the option of that name."""
    from tvmbridge.errors import ConversionError, FallbackWarning

    entry = get(entry) if isinstance(entry, str) else entry
    result = CaseResult(entry.name, entry.family, note=entry.note)
    options, note = compile_options(verify, fallback)
    result.note = "; ".join(x for x in (entry.note, note) if x)
    start = time.perf_counter()
    case = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            case = Case(entry, options, via, device, autocast)
            first = to_device(entry.make_batch(*FIRST, 1), device)
            case.train_step("step 1", first)
            case.train_step("step 2", first)
            case.train_step("step 3", to_device(entry.make_batch(*SECOND, 2), device))
            case.eval_step(first)
            compiled = case.variant_count()
            case.eval_step(first, "eval again")  # a second eval phase: what the first compiled serves it
            if case.variant_count() > compiled:
                note = f"the second eval phase compiled {case.variant_count() - compiled} more variant(s)"
                result.note = "; ".join(x for x in (result.note, note) if x)
            result.verdict = "EXACT"
        except _StepError as failed:
            exc, role = failed.exc, failed.role
            if role != "tvm":
                result.verdict = "SKIP"
                result.reason = f"{role} failed at {failed.where}: {_first_line(exc)}"
            elif isinstance(exc, ConversionError):
                result.verdict, result.reason = "REFUSED", f"{failed.where}: {_first_line(exc)}"
            else:
                result.verdict = "CRASH"
                result.reason = f"{failed.where}: {_first_line(exc)} (at {_where(exc)})"
        except Exception as exc:  # noqa: BLE001 - the harness's own bug: named so it is fixed
            result.verdict, result.reason = "SKIP", f"harness failed: {_first_line(exc)} (at {_where(exc)})"
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    dispatchers = case.dispatchers() if case is not None else []
    if case is not None and dispatchers:
        variants = [v for d in dispatchers for v in d.variants]
        result.variants = len(variants)
        result.compile_s = round(sum(v.compiled.seconds_total() for v in variants), 2)
        result.variant_why = [f"{v.label}: {v.why}" for v in variants]
        step3 = [x for x in case.step3_variant or [] if x is not None]  # Variants, or strings where PyTorch ran
        result.symbolic = any(getattr(x, "symbolic", False) for x in step3) if step3 else None
        fallbacks += [f"{n} x PyTorch: {why}" for d in dispatchers for why, n in d.fallback_reasons.items()]
    result.fallbacks = list(dict.fromkeys(fallbacks))
    if case is not None and case.closest[1]:
        result.closest = f"{case.closest[0]:.2f} at {case.closest[1]}"
    if case is not None and case.mismatches:
        _judge_mismatches(result, case)
    elif result.verdict == "EXACT" and result.fallbacks:
        result.verdict, result.reason = "FALLBACK", result.fallbacks[0]
    if timing and case is not None and result.verdict in ("EXACT", "FALLBACK"):
        try:
            result.tvm_ms, result.eager_ms = (round(t, 2) for t in case.time_steps(first))
            result.ratio = round(result.tvm_ms / result.eager_ms, 2) if result.eager_ms else None
        except Exception as exc:  # noqa: BLE001 - the verdict stands; say why there is no timing
            result.note = "; ".join(x for x in (result.note, f"timing failed: {_first_line(exc)}") if x)
    result.wall_s = round(time.perf_counter() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run one case in this process; print (or write) its result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name")
    parser.add_argument("--json-out", help="write the result here (default: print it)")
    verify_help = "CompileOptions.verify where it exists (default off: the raw state)"
    parser.add_argument("--verify", choices=("off", "on", "default"), default="off", help=verify_help)
    parser.add_argument("--no-timing", action="store_true")
    via_help = "add_tvm_dispatch (default) or torch.compile(backend=tvmbridge)"
    parser.add_argument("--via", choices=("dispatch", "backend"), default="dispatch", help=via_help)
    parser.add_argument("--fallback", action="store_true", help="add_tvm_dispatch(fallback=True)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model and batches live")
    parser.add_argument("--autocast", action="store_true", help="eager and TVM under bfloat16 autocast (see above)")
    args = parser.parse_args(argv)
    verify = {"off": False, "on": True, "default": None}[args.verify]
    result = run_case(
        args.name,
        verify=verify,
        timing=not args.no_timing,
        via=args.via,
        device=args.device,
        autocast=args.autocast,
        fallback=args.fallback,
    )
    text = json.dumps(asdict(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
