"""TRL: `AccumSFTTrainer` / `AccumSFTConfig` get hf_accum's tuner and exact normalization inside SFTTrainer."""

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import HfArgumentParser  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from hf_accum import AccumTrainingArguments, tiny  # noqa: E402
from hf_accum.trainer import AccumulationMixin  # noqa: E402
from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer  # noqa: E402

from .exactness import StepRecorder, max_step_error, recording, reference_run  # noqa: E402


def test_config_is_both_dataclasses_and_parses_from_a_dict(tmp_path):
    assert AccumSFTConfig.__mro__.index(SFTConfig) < AccumSFTConfig.__mro__.index(AccumTrainingArguments)
    assert issubclass(AccumSFTTrainer, AccumulationMixin) and issubclass(AccumSFTTrainer, SFTTrainer)
    assert AccumSFTTrainer.__mro__.index(AccumulationMixin) < AccumSFTTrainer.__mro__.index(SFTTrainer)
    names = {f.name for f in dataclasses.fields(AccumSFTConfig)}
    assert {"max_length", "packing", "target_batch_size", "loss_normalization", "memory_budget_bytes"} <= names
    (args,) = HfArgumentParser(AccumSFTConfig).parse_dict(
        {"output_dir": str(tmp_path), "target_batch_size": 12, "max_length": 64, "use_cpu": True, "bf16": False}
    )
    assert (args.target_batch_size, args.max_length, args.loss_normalization, args.tunes) == (12, 64, "tokens", True)
    with pytest.raises(ValueError, match="loss_normalization='mean' is not one of"):  # our checks run too
        AccumSFTConfig(output_dir=str(tmp_path), loss_normalization="mean", use_cpu=True, bf16=False)


def test_sft_trainer_plans_the_batch_and_its_gradients_are_one_pass_over_the_effective_batch(tmp_path):
    tok = tiny.build_tokenizer()
    rows = tiny.generate_instruction_data(24, seed=1)  # completions of 1 to ~30 characters
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows])
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    initial = copy.deepcopy(model)
    args = AccumSFTConfig(
        output_dir=str(tmp_path), target_batch_size=12, probe_max_micro_batch=4,  # the plan: micro 4 x accum 3
        num_train_epochs=1, learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_tqdm=True, max_length=64,
    )
    recorder = StepRecorder()
    trainer = recording(AccumSFTTrainer)(
        model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[recorder]
    )
    trainer.remove_callback(PrinterCallback)

    plan = trainer.tune()
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (4, 3)
    assert trainer.probe_result is not None and trainer.probe_result.trials
    # the probe ran TRL's compute_loss, but none of its steps show up in TRL's logged metrics
    assert trainer._total_train_tokens == 0 and not any(trainer._metrics["train"].values())
    trainer.train()

    # each window of 12 is loaded whole and cut by the engine into the plan's 3 forwards of 4
    assert trainer.args.per_device_train_batch_size == 12 and trainer.args.gradient_accumulation_steps == 1
    assert [len(w) for w in trainer.windows] == [1, 1]  # 24 samples = 2 optimizer steps of 4 x 3
    assert all(b["input_ids"].shape[0] == 12 for w in trainer.windows for b in w)
    # one process: transformers' flag has no effect, so it is left as given (it is turned off only with world > 1)
    assert trainer._normalization == "tokens" and trainer.args.average_tokens_across_devices is args.average_tokens_across_devices
    ref = reference_run(initial, recorder, trainer.windows, "causal")
    assert max_step_error(recorder, ref) < 1e-6  # float64 model; RMSNorm/rotary in float32 give ~1e-7
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx(ref.losses, rel=1e-6)
    first_step = next(h for h in trainer.state.log_history if "loss" in h)  # the plan's figures come first
    assert first_step["num_tokens"] == sum(
        int(b["attention_mask"].sum()) for b in trainer.windows[0]
    )


def test_eval_tokens_are_the_evaluation_tokens_and_eval_num_tokens_is_trl_s_training_count(tmp_path):
    """TRL logs `eval_num_tokens` as the training tokens seen so far: AccumSFTTrainer gives TRL's own SFTTrainer's
    number there, and adds `eval_tokens`, the evaluation set's tokens (its attention masks, counted here by hand)."""
    tok = tiny.build_tokenizer()

    def rows(n, seed):
        return Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]}
                                  for r in tiny.generate_instruction_data(n, seed=seed)])

    train, evaluation = rows(24, 1), rows(10, 2)
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    common = dict(num_train_epochs=1, learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                  seed=0, disable_tqdm=True, max_length=64, per_device_eval_batch_size=3)
    metrics = {}
    for cls, config, extra in [(SFTTrainer, SFTConfig, dict(per_device_train_batch_size=4, gradient_accumulation_steps=3)),
                               (AccumSFTTrainer, AccumSFTConfig, dict(target_batch_size=12, probe_max_micro_batch=4))]:
        args = config(output_dir=str(tmp_path / cls.__name__), **common, **extra)
        trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=train, eval_dataset=evaluation,
                      processing_class=tok)
        trainer.train()
        metrics[cls] = trainer.evaluate()
        trained = sum(int(b["attention_mask"].sum()) for b in trainer.get_train_dataloader())
        assert metrics[cls]["eval_num_tokens"] == trained  # TRL's meaning: the training tokens so far
    assert metrics[AccumSFTTrainer]["eval_num_tokens"] == metrics[SFTTrainer]["eval_num_tokens"]
    prepared = trainer.eval_dataset  # tokenized and truncated as TRL prepares it
    by_hand = sum(min(len(r["input_ids"]), 64) for r in prepared)
    assert metrics[AccumSFTTrainer]["eval_tokens"] == by_hand
    assert by_hand != metrics[AccumSFTTrainer]["eval_num_tokens"]
    assert "eval_tokens" not in metrics[SFTTrainer]


def test_examples_truncation_leaves_no_completion_are_counted_and_said(tmp_path, caplog):
    """Issue 59, item 9: half the examples longer than max_length trained on the other half, and only the example
    count showed it. TRL drops an example whose completion truncation cut away; the run now says how many, why and
    how to keep them."""
    import logging

    tok = tiny.build_tokenizer()

    def rows(long_every):
        return Dataset.from_list([{"prompt": [{"role": "user", "content": "abc " * (60 if i % long_every == 0 else 3)}],
                                   "completion": [{"role": "assistant", "content": "ok"}]} for i in range(40)])

    def build(data):
        args = AccumSFTConfig(output_dir=str(tmp_path), target_batch_size=8, max_length=64, max_steps=1,
                              report_to="none", use_cpu=True)
        with caplog.at_level(logging.WARNING, logger="hf_accum"):
            return AccumSFTTrainer(model=tiny.build_model(tokenizer=tok), args=args, train_dataset=data,
                                   processing_class=tok)

    trainer = build(rows(2))
    assert len(trainer.train_dataset) == 20
    said = [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()]
    assert said == ["hf_accum: 20 of 40 training examples were dropped: truncated to max_length=64 they keep no "
                    "completion token (TRL drops them). To train on them, raise max_length or shorten their prompts."]
    caplog.clear()
    build(rows(1000))  # only the first example is long: one dropped
    assert [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()][0].startswith(
        "hf_accum: 1 of 40 training examples were dropped")


@pytest.mark.parametrize("config, field", [("AccumSFTConfig", "max_length"), ("AccumDPOConfig", "max_length"),
                                           ("AccumRewardConfig", "max_length"),
                                           ("AccumGRPOConfig", "max_completion_length")])
@pytest.mark.parametrize("value", [-3, 0])
def test_a_token_limit_that_is_not_positive_is_refused(tmp_path, config, field, value):
    """Issue 59, item 1: max_length=-3 trained, as "drop the last 3 tokens" of every example."""
    import hf_accum.trl

    with pytest.raises(ValueError, match=rf"^{field}={value} must be a positive number of tokens \(or None: no limit\)"):
        getattr(hf_accum.trl, config)(output_dir=str(tmp_path), use_cpu=True, **{field: value})
    getattr(hf_accum.trl, config)(output_dir=str(tmp_path), use_cpu=True, **{field: None})  # no limit: allowed
