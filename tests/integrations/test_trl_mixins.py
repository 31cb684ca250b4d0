"""A user's own `class MyX(AccumulationMixin, trl.XTrainer)`: the mixin takes the batch unit from the TRL trainer it
is mixed into (`hf_accum.trl.TRL_TRAINERS`) or refuses at construction, naming what to use. One case per Trainer
class in trl's namespace: exact against an independent float64 reference (an out-of-memory error injected
mid-window where the unit matters), or refused with its message."""

import inspect
import logging

import pytest
import torch
import torch.nn.functional as F

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import Trainer  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from hf_accum import tiny  # noqa: E402
from hf_accum.trainer import AccumulationMixin  # noqa: E402
from hf_accum.trl import TRL_TRAINERS  # noqa: E402
from tests.exactness import StepRecorder, load_weights, max_relative_error, max_step_error, recording, reference_run  # noqa: E402
from tests.integrations.test_dpo import BETA, preference_data, sequence_logps  # noqa: E402
from tests.trainer.test_oom_recovery import OOMAt  # noqa: E402

# trl's namespace is lazy: every exported name, imported
TRL_TRAINER_CLASSES = sorted(n for n in trl.__all__ if inspect.isclass(getattr(trl, n))
                             and issubclass(getattr(trl, n), Trainer))

COMMON = dict(num_train_epochs=1, learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, report_to=[],
              save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_tqdm=True, max_length=64,
              gradient_checkpointing=False)


def mixed(name: str) -> type:
    """What a user writes before finding hf_accum.trl: the mixin in front of TRL's class, nothing else."""
    return type(f"My{name}", (AccumulationMixin, getattr(trl, name)), {})


def forwards_seen(model) -> list[int]:
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]) if m.training else None,
                                    with_kwargs=True)
    return seen


# --- the exact ones -------------------------------------------------------------------------------------------
def dpo_exact(tmp_path, caplog, config_cls=trl.DPOConfig, **config):
    """16 pairs, windows of 2 x 4 pairs; the 3rd forward (window 2's first) runs out of memory. The reference
    log-probabilities come from TRL's reference model inside compute_loss (no per-pair tensor in the batch), so
    before the mixin took pairs from DPOTrainer nothing stopped the re-run from cutting chosen rows from their
    rejected ones. Reference: the mean over the window's pairs of -logsigmoid(beta * (policy - reference
    log-ratio)), float64, from one forward per recorded batch."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    initial = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    fresh = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      beta=BETA, precompute_ref_log_probs=False, **COMMON, **config)
    recorder = StepRecorder()
    reference_model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    trainer = recording(mixed("DPOTrainer"))(model=model, ref_model=reference_model, args=args,
                                            train_dataset=preference_data(16), processing_class=tok,
                                            callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    assert (trainer.batch_unit, trainer._normalization) == ("pairs", "samples")
    seen = forwards_seen(model)
    OOMAt(model.model.layers[1], (3,))
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert "out of memory at step 1" in caplog.text
    assert seen[:3] == [8, 8, 8] and set(seen[3:]) == {4} and len(seen) == 3 + 4  # whole pairs after the OOM
    ref = []
    for weights, window in zip(recorder.weights, trainer.windows):
        load_weights(fresh, weights)
        fresh.zero_grad(set_to_none=True)
        terms = []
        for b in window:
            chosen, rejected = sequence_logps(fresh, b).chunk(2)
            with torch.no_grad():
                ref_chosen, ref_rejected = sequence_logps(initial, b).chunk(2)
            terms.append(-F.logsigmoid(BETA * ((chosen - ref_chosen) - (rejected - ref_rejected))))
        torch.cat(terms).mean().backward()
        ref.append({n: p.grad.clone() for n, p in fresh.named_parameters() if p.grad is not None})
    return max_relative_error(recorder.grads, ref)


def reward_exact(tmp_path, caplog, config_cls=trl.RewardConfig, trainer_cls=None):
    """Plain RewardConfig with reward centering, 20 pairs, windows of 3 x 2 pairs (the last one 2), an OOM in the
    2nd forward (micro 3 -> 2 pairs). Reference: the mean over the window's pairs of -logsigmoid(r_c - r_r) + c (r_c + r_r)^2, float64."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model("seq_cls", tokenizer=tok, dtype=torch.float64, hidden_size=32, num_labels=1)
    fresh = tiny.build_model("seq_cls", tokenizer=tok, dtype=torch.float64, hidden_size=32, num_labels=1)
    pairs = preference_data(20)
    data = Dataset.from_list([{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                              for r in pairs])
    center = 0.05
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2,
                      center_rewards_coefficient=center, **COMMON)
    recorder = StepRecorder()
    trainer = recording(trainer_cls or mixed("RewardTrainer"))(model=model, args=args, train_dataset=data, processing_class=tok,
                                               callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    assert (trainer.batch_unit, trainer._normalization) == ("pairs", "samples")
    seen = forwards_seen(model)
    OOMAt(model.model.layers[1], (2,))
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert "out of memory at step 0" in caplog.text
    # after the OOM each loaded batch of 3 pairs runs as 1 + 2 whole pairs (the longest pair in the smaller forward);
    # the last window is one batch of 2 pairs
    assert seen == [6, 6] + [2, 4] * 6 + [4]
    assert [sum(b["input_ids"].shape[0] // 2 for b in w) for w in trainer.windows] == [6, 6, 6, 2]
    ref = []
    for weights, window in zip(recorder.weights, trainer.windows):
        load_weights(fresh, weights)
        fresh.zero_grad(set_to_none=True)
        terms = []
        for b in window:
            chosen, rejected = fresh(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, 0].chunk(2)
            terms.append(-F.logsigmoid(chosen - rejected) + center * (chosen + rejected) ** 2)
        torch.cat(terms).mean().backward()
        ref.append({n: p.grad.clone() for n, p in fresh.named_parameters() if p.grad is not None})
    return max_relative_error(recorder.grads, ref)


def sft_exact(tmp_path, caplog):
    """Plain SFTConfig (the token mean), 24 prompt-completion rows, windows of 3 x 4 rows, an OOM mid-window."""
    tok = tiny.build_tokenizer()
    rows = tiny.generate_instruction_data(24, seed=1)
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows])
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    initial = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=3,
                         **COMMON)
    recorder = StepRecorder()
    trainer = recording(mixed("SFTTrainer"))(model=model, args=args, train_dataset=data, processing_class=tok,
                                            callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    assert (trainer.batch_unit, trainer._normalization) == (None, "tokens")
    OOMAt(model.model.layers[1], (2,))
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert "out of memory at step 0" in caplog.text
    return max_step_error(recorder, reference_run(initial, recorder, trainer.windows, "causal"))


def grpo_exact(tmp_path, caplog):
    """Plain GRPOConfig (loss_type='grpo': a mean over completions), one generation batch of 20 completions as 4
    slices of 5, an OOM in the 2nd forward (then 3 + 2 completions per slice). Reference: tests/integrations/test_grpo.py's loss
    by hand over the whole generation batch (TRL's fused head computes log-probabilities in float32: 1e-6)."""
    from tests.integrations.test_grpo import grpo_run, reference_grad

    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer, recorder, initial, seen = grpo_run(tmp_path, mixed("GRPOTrainer"), trl.GRPOConfig, 5, 4,
                                                    oom_calls=(2,), loss_type="grpo")
    assert "out of memory at step 0" in caplog.text
    assert (trainer.batch_unit, trainer._normalization) == ("rows", "samples")
    assert seen[:2] == [5, 5] and sum(seen[2:]) == 20 and set(seen[2:]) == {2, 3}
    want = reference_grad(initial, recorder.weights[0], trainer.windows[0], "grpo", 0.0, False, tiny.build_tokenizer())
    return max_relative_error(recorder.grads, [want])


EXACT = {"DPOTrainer": dpo_exact, "RewardTrainer": reward_exact, "SFTTrainer": sft_exact, "GRPOTrainer": grpo_exact}


def test_the_table_holds_exactly_the_trainers_trl_exports():
    # A TRL release that adds, renames or drops a trainer fails here: decide its unit (or refusal) in TRL_TRAINERS.
    assert TRL_TRAINER_CLASSES and set(TRL_TRAINERS) == set(TRL_TRAINER_CLASSES)
    assert {n for n, m in TRL_TRAINERS.items() if m.refusal is None} == set(EXACT)


@pytest.mark.parametrize("name", TRL_TRAINER_CLASSES)
def test_each_trl_trainer_mixed_in_is_exact_or_refused(name, tmp_path, caplog):
    if name in EXACT:
        assert EXACT[name](tmp_path, caplog) <= 1e-6
        return
    cls = mixed(name)
    with pytest.raises(ValueError, match=rf"^My{name} mixes AccumulationMixin into trl\.{name}: .*"
                                         rf"Use {name} without AccumulationMixin\.$"):
        cls(model="not loaded: refused first")
    assert not any(tmp_path.iterdir())


def test_plain_grpo_config_gets_accum_grpo_configs_checks(tmp_path):
    # bnpo's loss depends on the cut: refused at construction, before any model work, naming dapo
    with pytest.raises(ValueError, match=r"^MyGRPOTrainer \(hf_accum over trl\.GRPOTrainer\): loss_type='bnpo' .* "
                                         r"Use loss_type='dapo'"):
        mixed("GRPOTrainer")(model=tiny.build_model("causal_lm", hidden_size=32), reward_funcs=[len],
                             args=trl.GRPOConfig(output_dir=str(tmp_path), loss_type="bnpo", num_generations=2,
                                                 per_device_train_batch_size=2, use_cpu=True, report_to=[]),
                             train_dataset=Dataset.from_list([{"prompt": "a"}] * 4),
                             processing_class=tiny.build_tokenizer())


def test_a_trl_trainer_missing_from_the_table_is_refused():
    from trl.experimental.orpo import ORPOTrainer

    with pytest.raises(ValueError, match=r"into trl\.experimental\.orpo\.orpo_trainer\.ORPOTrainer: hf_accum does not know the unit"):
        type("MyORPO", (AccumulationMixin, ORPOTrainer), {})(model="not loaded")


def test_a_trl_trainer_replaced_by_a_subclass_in_trls_namespace_is_still_known(monkeypatch):
    # unsloth (and trl_swap_suite.py's swap) put a subclass in place of trl.RewardTrainer: the mixin must still know
    # RewardTrainer's unit, not refuse it as an unknown TRL class
    from hf_accum.trl import AccumRewardTrainer, mixed_into

    patched = type("PatchedRewardTrainer", (trl.RewardTrainer,), {})
    monkeypatch.setattr(trl, "RewardTrainer", patched)
    assert mixed_into(AccumRewardTrainer) == ("trl.RewardTrainer", TRL_TRAINERS["RewardTrainer"])
    monkeypatch.setattr(trl, "RewardTrainer", object)  # not a subclass: not TRL's RewardTrainer any more
    assert mixed_into(AccumRewardTrainer)[1].refusal is not None


def dpo_trainer(tmp_path, cls, **config):
    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, precompute_ref_log_probs=True,
                         **{**COMMON, **config})
    return cls(model=model, args=args, train_dataset=preference_data(8), processing_class=tok)


def test_plain_dpo_config_gets_accum_dpo_configs_checks(tmp_path):
    with pytest.raises(ValueError, match=r"^MyDPOTrainer \(hf_accum over trl\.DPOTrainer\): loss_type=\['aot'\] is "
                                         r"not a mean of per-pair terms"):
        dpo_trainer(tmp_path, mixed("DPOTrainer"), loss_type=["aot"])


def test_a_declared_unit_that_contradicts_the_trl_trainer_is_refused(tmp_path):
    rows = type("RowsDPO", (AccumulationMixin, trl.DPOTrainer), {"batch_unit": "rows"})
    with pytest.raises(ValueError, match=r"RowsDPO declares batch_unit='rows', but trl\.DPOTrainer collates pairs"):
        rows(model="not loaded")


def test_check_accumulation_passes_on_a_mixed_in_dpo_trainer(tmp_path):
    result = dpo_trainer(tmp_path, mixed("DPOTrainer")).check_accumulation(num_micro_batches=2)
    assert result.passed and result.relative_error < 1e-6 and result.micro_batch_sizes == [2, 2]


def test_mixed_in_dpo_with_an_accum_dpo_config_and_a_target_is_exact_through_an_oom(tmp_path, caplog):
    from hf_accum.trl import AccumDPOConfig

    assert dpo_exact(tmp_path, caplog, AccumDPOConfig, target_batch_size=8, auto_tune=False) <= 1e-6


def test_the_probes_steps_stay_out_of_trls_metrics_in_a_users_mixin(tmp_path):
    from hf_accum.trl import AccumSFTConfig

    tok = tiny.build_tokenizer()
    rows = tiny.generate_instruction_data(12, seed=1)
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows])
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    args = AccumSFTConfig(output_dir=str(tmp_path), target_batch_size=4, probe_max_micro_batch=2, **COMMON)
    trainer = mixed("SFTTrainer")(model=model, args=args, train_dataset=data, processing_class=tok)
    plan = trainer.tune()
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (2, 2) and trainer.probe_result.trials
    assert trainer._total_train_tokens == 0 and not any(trainer._metrics["train"].values())
    trainer.check_accumulation()
    assert trainer._total_train_tokens == 0 and not any(trainer._metrics["train"].values())
