"""Hugging Face training code as users write it: ``Trainer`` with its default arguments, and
dynamic padding (a new sequence length every batch) served by one symbolic variant."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tvmbridge import VerificationWarning, add_tvm_dispatch  # noqa: E402


def _bert(num_labels: int = 3) -> torch.nn.Module:
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, num_labels=num_labels, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _rows(n: int = 24) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = int(torch.randint(5, 12, (1,), generator=g))
        rows.append({"input_ids": torch.randint(1, 100, (length,), generator=g), "label": i % 3,
                     "text": "a column the model does not take"})
    return rows


def _collate(rows: list[dict]) -> dict:
    """Dynamic padding: each batch as long as its longest row."""
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = r["input_ids"]
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
            "labels": torch.tensor([r["label"] for r in rows])}


def _train(model: torch.nn.Module, out_dir: str, **options) -> list[float]:
    args = transformers.TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=5,
                                          logging_steps=1, report_to=[], seed=0, use_cpu=True, save_strategy="no",
                                          disable_tqdm=True, **options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_rows(), data_collator=_collate)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_with_default_arguments_matches_the_eager_trainer(tmp_path) -> None:
    """remove_unused_columns (the default) reads the forward's signature; the model is called
    with keywords and Trainer's num_items_in_batch; every batch has another length."""
    eager = _train(_bert(), str(tmp_path / "eager"))
    model = add_tvm_dispatch(_bert())
    with warnings.catch_warnings():
        warnings.simplefilter("error", VerificationWarning)
        tvm = _train(model, str(tmp_path / "tvm"))
    assert len(tvm) == len(eager) == 5
    for a, b in zip(tvm, eager):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (tvm, eager)
    dispatch = model._tvm_dispatch
    assert dispatch.calls_fallback == 0
    assert len(dispatch.variants) <= 2 and any(v.symbolic for v in dispatch.variants), dispatch.explain()


def test_trainer_with_gradient_checkpointing_trains_compiled_and_matches(tmp_path) -> None:
    """``gradient_checkpointing=True`` installs transformers' ``make_inputs_require_grads`` forward
    hook on the input embeddings, which the hook refusal took for a hook compiled code would miss:
    every such model raised. Its whole effect is autograd's, so the model compiles; checkpointing
    itself is the capture set's business there."""
    fields = transformers.TrainingArguments.__dataclass_fields__  # renamed in transformers 5
    checkpointing = {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": True}
    eager = _train(_bert(), str(tmp_path / "eager"), **checkpointing)
    model = add_tvm_dispatch(_bert())
    with warnings.catch_warnings():
        warnings.simplefilter("error", VerificationWarning)
        tvm = _train(model, str(tmp_path / "tvm"), **checkpointing)
    assert model.bert.embeddings.word_embeddings._forward_hooks  # the hook is there, and kept
    assert len(tvm) == len(eager) == 5
    for a, b in zip(tvm, eager):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (tvm, eager)
    assert model._tvm_dispatch.calls_fallback == 0 and model._tvm_dispatch.calls_tvm == 5


def test_a_frozen_base_with_input_gradients_enabled_trains_its_head_compiled() -> None:
    """PEFT's recipe: the base frozen, ``enable_input_require_grads`` so gradients reach what
    is trainable after the embeddings; here only the classifier trains."""
    eager = _bert()
    for p in eager.bert.parameters():
        p.requires_grad_(False)
    eager.enable_input_require_grads()
    model = add_tvm_dispatch(copy.deepcopy(eager))
    batch = _collate(_rows(4))
    grads = []
    for m in (model, eager):
        torch.manual_seed(0)
        out = m(**batch)
        out.loss.backward()
        grads.append([out.loss.detach()] + [p.grad for p in m.parameters() if p.requires_grad])
    assert model._tvm_dispatch.calls_tvm == 1 and len(grads[0]) == len(grads[1]) == 3
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_dynamic_padding_loop_one_symbolic_variant_exact() -> None:
    """Without the safety net: the symbolic variant itself is right (outputs and every gradient)."""
    eager = _bert()
    model = add_tvm_dispatch(copy.deepcopy(eager), verify=False)
    rows = _rows(16)
    for step in range(4):
        batch = _collate(rows[4 * step: 4 * step + 4])
        grads = []
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = m(**batch)
            out.loss.backward()
            grads.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
        torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-5)
        for name, g in grads[1][1].items():
            got = grads[0][1][name]
            assert (got is None) == (g is None), name
            if g is not None:
                torch.testing.assert_close(got, g, rtol=1e-4, atol=1e-5, msg=name)
    assert any(v.symbolic for v in model._tvm_dispatch.variants), model._tvm_dispatch.explain()


def test_trainer_with_a_model_compiled_by_the_backend_matches_the_eager_trainer(tmp_path) -> None:
    """Accelerate knows only its own dynamo backend names: the model is compiled in place
    (``model.compile(backend=...)``: it keeps its class and forward signature, which Trainer reads
    to drop unused columns; a ``torch.compile`` wrapper's is ``(*args, **kwargs)``) before it is
    handed to Trainer. Every batch has another length (dynamo's automatic dynamic shapes)."""
    from tvmbridge import FallbackWarning, compile_backend

    torch._dynamo.reset()
    eager = _train(_bert(), str(tmp_path / "eager"))
    backend = compile_backend()
    with warnings.catch_warnings():
        warnings.simplefilter("error", VerificationWarning)
        warnings.simplefilter("error", FallbackWarning)
        model = _bert()
        model.compile(backend=backend)
        tvm = _train(model, str(tmp_path / "tvm"))
    assert len(tvm) == len(eager) == 5
    for a, b in zip(tvm, eager):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (tvm, eager)
    assert backend.graphs and all(g.dispatcher.calls_tvm > 0 and g.dispatcher.calls_fallback == 0
                                  for g in backend.graphs), backend.explain()
    torch._dynamo.reset()


def test_generation_with_a_key_value_cache_runs_pytorch_and_matches() -> None:
    """``generate`` passes a ``DynamicCache`` that each step's forward extends. Compiled, it
    would be frozen as the trace found it (and the guard let the same, grown, object through);
    the trace also wrote its fake tensors into the caller's cache, and the first call's check
    then failed inside PyTorch ('Could not guard on data-dependent expression'). Such calls run
    PyTorch, said once; the same tokens come out."""
    from tvmbridge import FallbackWarning

    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ref = copy.deepcopy(model)
    add_tvm_dispatch(model)
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(9))
    with pytest.warns(FallbackWarning, match="DynamicCache object.*use_cache=False"), torch.no_grad():
        got = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    want = ref.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(got, want)
    assert model._tvm_dispatch.calls_tvm == 0 and not model._tvm_dispatch.discarded


def test_hidden_states_once_then_training_stays_compiled_and_every_output_is_eager_s() -> None:
    """transformers installs output-capturing hooks on the layers at the first
    ``output_hidden_states=True`` call. The trace of that call installed them too and left them:
    the call's PyTorch run installed a second set (five hidden states for a two-layer model, not
    three), and every later call ran PyTorch ('hooks do not run inside compiled code'). Those
    hooks act only within the model's own call, so they are traced; training stays compiled."""
    torch.manual_seed(0)
    model = _bert()
    ref = copy.deepcopy(model)
    add_tvm_dispatch(model)
    batch = _collate(_rows(3))
    for step in range(4):
        hidden = step in (1, 2)
        outs = []
        for net in (model, ref):
            net.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = net(**batch, output_hidden_states=hidden)
            out.loss.backward()
            outs.append(out)
        torch.testing.assert_close(outs[0].loss, outs[1].loss)
        if hidden:
            assert len(outs[0].hidden_states) == len(outs[1].hidden_states) == 3
            for got, want in zip(outs[0].hidden_states, outs[1].hidden_states):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert model._tvm_dispatch.calls_fallback == 1  # the first hidden-states call, which installs the hooks
    assert model._tvm_dispatch.calls_tvm == 3
