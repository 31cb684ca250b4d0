"""The fused causal-LM loss (hf_accum/levers/kernels/fused_loss.py): same gradient and logged loss as one pass over the window with
cross-entropy computed by hand in float64 from the full logits; refused (auto: off, True: an error) where it cannot be
exact; training only.

The reference never goes through hf_accum or the model's loss: the recorded micro-batches are forwarded with the
recorded weights, `F.cross_entropy(reduction="sum")` on float64 logits, divided by the window's count of tokens or
samples."""

import copy
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening
from transformers.trainer_callback import PrinterCallback

import hf_accum.levers.kernels.fused_loss as fl
from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.levers.kernels import chunked
from hf_accum.planning.store import PLAN_FILE
from tests.exactness import (
    MeanCrossEntropyLoss,
    StepRecorder,
    lm_examples,
    logged_losses,
    lora,
    merge,
    pad_collate,
    recording,
    relative_error,
    sum_over_items_loss,
    tiny_llama,
    tiny_llama_cls,
)

TOL = 1e-6


# --- harness ----------------------------------------------------------------------------------------------------
@pytest.fixture
def fused_calls(monkeypatch):
    """Counts fused loss evaluations, so a test knows training really went through the fused path."""
    calls = []
    original = fl.token_loss_sum

    def counting(hidden, weight, bias, targets, kernel=None, paper=False):
        calls.append((tuple(hidden.shape), fl.implementation_for(hidden, weight, kernel)))
        return original(hidden, weight, bias, targets, kernel, paper)

    monkeypatch.setattr(fl, "token_loss_sum", counting)
    return calls


def train(model, tmp_path, *, collate=pad_collate, data=None, trainer_cls=AccumTrainer, trainer_kwargs=None, **args):
    """One epoch, micro 3 x accumulation 4 (a full window, then a shorter one), recording each step."""
    kwargs = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=4, num_train_epochs=1,
        learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0, disable_tqdm=True, remove_unused_columns=False,
    )
    kwargs.update(args)
    recorder = StepRecorder()
    trainer = recording(trainer_cls)(
        model=model, args=AccumTrainingArguments(**kwargs), train_dataset=data or lm_examples(16, seed=1),
        data_collator=collate, callbacks=[recorder], **(trainer_kwargs or {}),
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer, recorder


def _targets(batch):
    """The (rows, targets) of a batch, as the model should score them: pre-shifted when shift_labels is given."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return F.pad(batch["labels"][:, 1:], (0, 1), value=-100)


def reference_grads(initial, recorder, windows, mode="tokens"):
    """Per step: the gradient of sum(token CE in float64 by hand) / window count. Padded micro-batches are merged
    into one batch (one forward); flattened (padding-free) ones are forwarded row by row as trained."""
    model = copy.deepcopy(initial).train()
    params = dict(model.named_parameters())
    grads, losses = [], []
    for weights, batches in zip(recorder.weights, windows):
        with torch.no_grad():
            for n, w in weights.items():
                params[n].copy_(w)
        model.zero_grad(set_to_none=True)
        parts = [merge(batches)] if "position_ids" not in batches[0] else batches
        total, tokens = 0, 0
        for b in parts:
            inputs = {k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "position_ids")}
            # use_cache=False as in training: with a cache transformers does not read packed sequences from position_ids
            logits = model(**inputs, use_cache=False).logits.double()
            y = _targets(b)
            total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                                            reduction="sum")
            tokens += int(y.ne(-100).sum())
        count = tokens if mode == "tokens" else sum(b["input_ids"].shape[0] for b in batches)
        loss = total / count
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        losses.append(loss.item())
    return grads, losses


def check_exact(trainer, recorder, initial, mode="tokens", tol=TOL):
    grads, losses = reference_grads(initial, recorder, trainer.windows, mode)
    errors = [relative_error(got, want) for got, want in zip(recorder.grads, grads)]
    assert len(errors) == len(trainer.windows) >= 2 and max(errors) <= tol, errors
    assert logged_losses(trainer) == pytest.approx(losses, rel=1e-6)
    for got in recorder.grads:  # every trainable parameter got a (non-zero) gradient
        assert all(float(g.abs().sum()) > 0 for g in got.values())


# --- exactness ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "chunked"])
@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_fused_equals_one_pass_by_hand(impl, mode, tmp_path, monkeypatch, fused_calls):
    if impl == "torch" and not fl.torch_features.HAS_LINEAR_CROSS_ENTROPY:
        pytest.skip("this torch has no F.linear_cross_entropy (the chunked fallback is tested)")
    monkeypatch.setattr(fl, "IMPLEMENTATION", impl)
    monkeypatch.setattr(chunked, "chunk_rows", lambda vocab, logits=0: 7)  # several chunks per micro-batch, a ragged last one
    model = tiny_llama()
    initial = copy.deepcopy(model)
    trainer, recorder = train(model, tmp_path, loss_normalization=mode)
    assert trainer.fused_loss_active is True
    assert len(fused_calls) == 6 and {c[1] for c in fused_calls} == {impl}  # 6 micro-batches, all fused
    assert [len(w) for w in trainer.windows] == [4, 2]
    check_exact(trainer, recorder, initial, mode)
    assert "forward" not in fl.causal_lm_module(model).__dict__  # the patch is gone after train()


def test_default_float64_path_is_torch_linear_cross_entropy(tmp_path, fused_calls):
    trainer, _ = train(tiny_llama(), tmp_path)
    expected = "torch" if fl.torch_features.HAS_LINEAR_CROSS_ENTROPY else "chunked"
    assert trainer.fused_loss_active and {c[1] for c in fused_calls} == {expected}


@pytest.mark.parametrize("with_shift_labels", [False, True])
def test_padding_free_batches_and_shift_labels(with_shift_labels, tmp_path, fused_calls):
    flatten = DataCollatorWithFlattening(return_position_ids=True)

    def collate(examples):
        batch = flatten(examples)
        if with_shift_labels:
            # Pre-shifted targets; labels set to something else, so using them instead would show.
            batch["shift_labels"] = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
            batch["labels"] = batch["input_ids"].clone()
        return batch

    model = tiny_llama()
    initial = copy.deepcopy(model)
    trainer, recorder = train(model, tmp_path, collate=collate)
    assert trainer.fused_loss_active and len(fused_calls) == 6
    assert all(b["input_ids"].shape[0] == 1 and "position_ids" in b for w in trainer.windows for b in w)
    check_exact(trainer, recorder, initial)


def test_lora_with_frozen_head(tmp_path, fused_calls):
    model = lora(tiny_llama())
    initial = copy.deepcopy(model)
    trainer, recorder = train(model, tmp_path)
    assert trainer.fused_loss_active and len(fused_calls) == 6
    assert all(n.count("lora_") for n in recorder.grads[0]) and len(recorder.grads[0]) == 8  # 2 layers x q,v x A,B
    check_exact(trainer, recorder, initial)


def test_tied_embeddings(tmp_path, fused_calls):
    model = tiny_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    initial = copy.deepcopy(model)
    trainer, recorder = train(model, tmp_path)
    assert trainer.fused_loss_active and len(fused_calls) == 6
    check_exact(trainer, recorder, initial)


def test_gradient_checkpointing(tmp_path, fused_calls):
    model = tiny_llama()
    initial = copy.deepcopy(model)
    trainer, recorder = train(model, tmp_path, gradient_checkpointing=True,
                              gradient_checkpointing_kwargs={"use_reentrant": False})
    assert trainer.fused_loss_active and len(fused_calls) == 6 and model.is_gradient_checkpointing
    check_exact(trainer, recorder, initial)


def test_bf16_autocast_matches_the_unfused_bf16_run(tmp_path, fused_calls):
    runs = {}
    for fused in (True, False):
        model = tiny_llama(torch.float32)
        trainer, recorder = train(model, tmp_path / str(fused), bf16=True, fused_loss=fused)
        runs[fused] = (recorder, logged_losses(trainer))
        # accelerate wrapped the model's forward for autocast; outside training nothing is fused any more
        model.train()
        ids = torch.tensor([[1, 2, 3, 4]])
        assert model(input_ids=ids, labels=ids).logits.shape == (1, 4, model.config.vocab_size)
    assert {c[1] for c in fused_calls} == {"chunked"}  # bf16: float32 CE on bf16 logits, as the unfused path
    (fused_rec, fused_losses), (plain_rec, plain_losses) = runs[True], runs[False]
    for got, want in zip(fused_rec.grads, plain_rec.grads):
        assert relative_error(got, want) <= 2e-2
    assert fused_losses == pytest.approx(plain_losses, rel=2e-3)


# --- training only ---------------------------------------------------------------------------------------------
def test_evaluation_and_calls_without_labels_get_the_logits(tmp_path, fused_calls):
    seen = []

    def keep_shape(logits, labels):
        seen.append(tuple(logits.shape))
        return logits.argmax(-1)

    model = tiny_llama()
    trainer, _ = train(model, tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                       data=lm_examples(8, seed=1),
                       trainer_kwargs={"eval_dataset": lm_examples(4, seed=2), "preprocess_logits_for_metrics": keep_shape,
                                       "compute_metrics": lambda p: {"n": float(len(p.predictions))}})
    assert trainer.fused_loss_active and len(fused_calls) == 3  # 8 samples / micro 3: training micro-batches only
    assert seen and all(s[-1] == model.config.vocab_size for s in seen)  # evaluation had the full logits
    assert any("eval_n" in h for h in trainer.state.log_history)

    ids = torch.tensor([[5, 6, 7, 8]])
    with fl.fused_lm_loss(model):
        model.train()
        fused = model(input_ids=ids, labels=ids)
        assert fused.logits is None and fused.loss is not None
        assert model(input_ids=ids).logits.shape == (1, 4, model.config.vocab_size)  # no labels: not fused
        model.eval()
        plain = model(input_ids=ids, labels=ids)
        assert plain.logits is not None
        assert float(fused.loss) == pytest.approx(float(plain.loss), rel=1e-6)


def test_probe_measures_fused_and_the_plan_key_records_it(tmp_path, fused_calls):
    keys = {}
    for fused in (None, False):
        model = tiny_llama(torch.float32)
        out = tmp_path / str(fused)
        args = AccumTrainingArguments(
            output_dir=str(out), target_batch_size=4, probe_seq_len=16, probe_max_micro_batch=2, use_cpu=True,
            report_to=[], fused_loss=fused, memory_budget_bytes=2**30,
        )
        trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(4), data_collator=pad_collate)
        before = len(fused_calls)
        trainer.tune()
        assert (len(fused_calls) > before) == (fused is None)  # the probe's steps used the fused loss
        with open(os.path.join(out, PLAN_FILE)) as f:
            keys[fused] = json.load(f)["key"]
    assert keys[None]["fused_loss"] is True and keys[False]["fused_loss"] is False


# --- refusals ------------------------------------------------------------------------------------------------------
def _lora_on_head(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False))


def _modules_to_save_head(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))


def _softcapped():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          final_logit_softcapping=30.0))


def _scaled():
    from transformers import CohereConfig, CohereForCausalLM

    torch.manual_seed(0)
    return CohereForCausalLM(CohereConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, logit_scale=0.0625))


class DoubledLogits(torch.nn.Module):
    """An LM head that post-processes its output in a way no config field names."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        return self.head(x) * 2


def _post_processed():
    model = tiny_llama(torch.float32)
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **{k: v for k, v in kwargs.items() if k not in ("labels", "num_items_in_batch")})
        out.logits = out.logits * 2  # e.g. an unknown logit multiplier in a custom model's forward
        if kwargs.get("labels") is not None:
            lg, y = out.logits[:, :-1], kwargs["labels"][:, 1:]
            out.loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), y.reshape(-1))
        return out

    model.forward = forward
    return model


def _router_loss():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                            num_experts_per_tok=2, output_router_logits=True,
                                            router_aux_loss_coef=0.5))


REFUSED_MODELS = {
    "lora_on_lm_head": (lambda: _lora_on_head(tiny_llama(torch.float32)), "LM head is a peft"),
    "modules_to_save_lm_head": (lambda: _modules_to_save_head(tiny_llama(torch.float32)), "ModulesToSaveWrapper"),
    "softcapping": (_softcapped, "final_logit_softcapping=30.0 softcaps"),
    "logit_scale": (_scaled, "logit_scale=0.0625 scales"),
    "unknown_post_processing": (_post_processed, "post-processes the LM head's output"),
    "moe_router_loss": (_router_loss, "not the plain cross-entropy"),
    "not_causal": (lambda: tiny_llama_cls(torch.float32), "not a causal language model"),
}


@pytest.mark.parametrize("name", list(REFUSED_MODELS))
def test_unsupported_models_are_refused(name, tmp_path):
    build, reason = REFUSED_MODELS[name]
    model = build()
    assert reason in (fl.unsupported_reason(model) or "")
    args = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    auto = AccumTrainer(model=model, args=AccumTrainingArguments(**args), train_dataset=lm_examples(4))
    assert fl.resolve_fused_loss(auto)[0] is False and reason in fl.resolve_fused_loss(auto)[1]
    required = AccumTrainer(model=model, args=AccumTrainingArguments(fused_loss=True, **args),
                            train_dataset=lm_examples(4), data_collator=pad_collate)
    with pytest.raises(ValueError, match=r"fused_loss=True, but .*Set fused_loss=False"):
        required.train()
    assert required.state.global_step == 0


TRAINER_REFUSALS = {
    "label_smoothing": (dict(args={"label_smoothing_factor": 0.1}), "label_smoothing_factor=0.1"),
    "compute_loss_func": (dict(kwargs={"compute_loss_func": sum_over_items_loss}), "compute_loss_func is set"),
    "compute_loss_override": (dict(mixin=MeanCrossEntropyLoss), "MeanCrossEntropyLoss.compute_loss overrides"),
}


@pytest.mark.parametrize("name", list(TRAINER_REFUSALS))
def test_trainer_settings_that_read_logits_turn_it_off(name, tmp_path, fused_calls):
    spec, reason = TRAINER_REFUSALS[name]
    cls = type("User", (spec["mixin"], AccumTrainer), {}) if "mixin" in spec else AccumTrainer
    initial = tiny_llama()
    trainer, recorder = train(copy.deepcopy(initial), tmp_path / "auto", trainer_cls=cls,
                              trainer_kwargs=spec.get("kwargs"), **spec.get("args", {}))
    assert trainer.fused_loss_active is False and not fused_calls
    assert reason in fl.resolve_fused_loss(trainer)[1]
    with pytest.raises(ValueError, match=f"fused_loss=True, but {reason}"):
        train(copy.deepcopy(initial), tmp_path / "required", trainer_cls=cls, trainer_kwargs=spec.get("kwargs"),
              fused_loss=True, **spec.get("args", {}))


def test_fused_loss_false_is_the_unfused_path(tmp_path, fused_calls):
    model = tiny_llama()
    initial = copy.deepcopy(model)
    trainer, recorder = train(model, tmp_path, fused_loss=False)
    assert trainer.fused_loss_active is False and not fused_calls
    assert fl.resolve_fused_loss(trainer) == (False, "fused_loss=False")
    check_exact(trainer, recorder, initial)


# --- DDP ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.xdist_group("torchrun")  # the multi-rank worker, where tests/integrations/test_ddp.py reads ddp_runs too
def test_two_ranks_fused_match_one_pass(ddp_runs):
    from tests.integrations.test_ddp import check_run

    ranks, windows, err, ref = check_run(ddp_runs, "causal_lm:0")  # the launch test_ddp.py checks: fused_loss unset
    assert all(r["fused"] is True for r in ranks)  # the default (fused_loss unset) fused on both ranks
    # the loss kernel, where the probe timed one: the ranks' measurements agreed (MAX), one choice on both ranks
    records = [((r["plan"] or {}).get("levers") or {}).get("loss_kernel") for r in ranks]
    assert records[0] == records[1]
    assert err <= TOL, err
    assert ranks[0]["losses"] == pytest.approx(ref.losses, rel=1e-6)


# --- TRL's SFTTrainer: its own fused head ---------------------------------------------------------------------
def _sft(tmp_path, model, **args):
    pytest.importorskip("trl")
    from datasets import Dataset

    from hf_accum import tiny
    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer

    tok = tiny.build_tokenizer()
    rows = tiny.generate_instruction_data(12, seed=1)
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows])
    config = AccumSFTConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=3, num_train_epochs=1,
        learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        bf16=False, seed=0, disable_tqdm=True, max_length=64, **args,
    )
    recorder = StepRecorder()
    trainer = recording(AccumSFTTrainer)(model=model, args=config, train_dataset=data, processing_class=tok,
                                         callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    return trainer, recorder


def _sft_model(adapter=None):
    from hf_accum import tiny

    model = tiny.build_model("causal_lm", tokenizer=tiny.build_tokenizer(), dtype=torch.float64, hidden_size=32)
    if adapter is None:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **adapter))


@pytest.mark.parametrize("fused", [None, False])
def test_sft_every_adapter_parameter_trains_and_is_exact(fused, tmp_path):
    from tests.exactness import max_step_error, reference_run

    model = _sft_model({"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]})
    initial = copy.deepcopy(model)
    trainer, recorder = _sft(tmp_path, model, fused_loss=fused)
    trainer.train()
    on, reason = fl.resolve_fused_loss(trainer)
    assert trainer.fused_loss_active is on is (fused is None) and "TRL's fused LM head" in reason
    # TRL logs entropy from its fused head's outputs only: present exactly when the fused head computed the loss
    assert any("entropy" in h for h in trainer.state.log_history) is (fused is None)
    names = set(recorder.grads[0])
    assert any("modules_to_save" in n for n in names) and sum("lora_" in n for n in names) == 8
    for got in recorder.grads:
        assert all(float(g.abs().sum()) > 0 for g in got.values())
    ref = reference_run(initial, recorder, trainer.windows, "causal")
    assert max_step_error(recorder, ref) <= TOL
    assert logged_losses(trainer) == pytest.approx(ref.losses, rel=1e-6)


@pytest.mark.parametrize("fused", [None, False])
def test_sft_lora_on_lm_head_is_refused(fused, tmp_path):
    with pytest.raises(ValueError, match="lm_head"):
        _sft(tmp_path, _sft_model({"target_modules": ["q_proj", "lm_head"]}), fused_loss=fused)


def test_sft_fused_loss_false_needs_the_nll_loss(tmp_path):
    with pytest.raises(ValueError, match="fused_loss=False computes the model's own"):
        _sft(tmp_path, _sft_model(), fused_loss=False, loss_type="dft")


# --- hf-accum probe --------------------------------------------------------------------------------------------
def test_probe_cli_switch(capsys):
    from hf_accum.cli import main

    small = ["probe", "--seq-len", "32", "--target-batch", "4", "--max-micro-batch", "2", "--budget-bytes", str(2**30)]
    for flag, line in ([], "fused loss: on (chunked"), (["--no-fused-loss"], "fused loss: off (--no-fused-loss)"):
        assert main(small + flag) == 0
        assert line in capsys.readouterr().out
    assert main(small + ["--lora", "--lora-target-modules", "q_proj,lm_head", "--fused-loss"]) == 2  # one-line error
    assert re.search(r"--fused-loss, but its LM head is a peft.*Set --no-fused-loss", capsys.readouterr().err)


def test_sharded_lm_head_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(fl.deepspeed_integration, "deepspeed_zero3_enabled", lambda: True)
    args = AccumTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = AccumTrainer(model=tiny_llama(torch.float32), args=args)
    assert fl.resolve_fused_loss(trainer) == (False, "FSDP / DeepSpeed ZeRO-3 shard the LM head's weight outside its forward")
    trainer.args.fused_loss = True
    with pytest.raises(ValueError, match="fused_loss=True, but FSDP"):
        fl.resolve_fused_loss(trainer)


@pytest.mark.parametrize("vocab, logits, rows", [
    (128256, 1 << 24, 128), (32000, 1 << 24, 512), (256, 1 << 24, 1024),  # the CPU's chunks, as before
    (128256, fl.ACCELERATOR_LOGITS_PER_CHUNK, 1024), (32000, fl.ACCELERATOR_LOGITS_PER_CHUNK, 1024),
    (10**7, 1 << 24, 64),
])
def test_chunk_rows(vocab, logits, rows):
    assert fl.chunk_rows(vocab, logits) == rows


def test_a_gpu_tensor_gets_the_larger_chunks(monkeypatch):
    """The device decides the chunk (H200: 128 rows cost 1.35x the unfused step, 1024 rows 1.09x); meta stands in
    for a GPU here."""
    seen = []
    monkeypatch.setattr(chunked, "loss_sum", lambda h, w, b, t, label_smoothing=0.0:
                        seen.append(chunked.rows_for(h.device.type, w.shape[0])) or h.sum())
    monkeypatch.setattr(fl, "implementation_for", lambda h, w, kernel=None: "chunked")
    for device in ("cpu", "meta"):
        fl.token_loss_sum(torch.zeros(4, 8, device=device), torch.zeros(128256, 8, device=device), None,
                          torch.zeros(4, dtype=torch.long, device=device))
    assert seen == [128, 1024]
