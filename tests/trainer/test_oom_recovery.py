"""Surviving an out-of-memory error mid-training (float64, CPU, injected OOMs): the run completes on the next
smaller micro-batch, the effective batch and step count are kept, and the result is the run that used the smaller
micro-batch from the start."""

import json
import logging

import pytest
import torch
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.planning.store import PLAN_FILE
from tests.exactness import (
    lm_examples,
    logged_losses,
    pad_collate,
    recording,
    sum_over_items_loss,
    tiny_gpt2,
    tiny_llama,
)


class OOMAt:
    """Forward pre-hook raising torch.OutOfMemoryError at the given (1-based) training forward calls."""

    def __init__(self, model, calls, *, training=True):
        self.calls, self.count, self.training = set(calls), 0, training
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if module.training != self.training:
            return
        self.count += 1
        if self.count in self.calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")


def run(tmp_path, micro, accum, oom_calls=(), epochs=1, n=32, **kw):
    model = tiny_gpt2()
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        target_batch_size=micro * accum, auto_tune=False, num_train_epochs=epochs, learning_rate=1e-2,
        max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, remove_unused_columns=False, **kw,
    )
    # GPT-2 and a float64 loss (transformers' causal-LM loss casts logits to float32): float64 end to end, so
    # runs that batch the same samples differently agree to ~1e-13 and 1e-10 is a meaningful bound.
    trainer = recording(AccumTrainer)(model=model, args=args, train_dataset=lm_examples(n, seed=4),
                                      data_collator=pad_collate, compute_loss_func=sum_over_items_loss)
    trainer.remove_callback(PrinterCallback)
    injector = OOMAt(model, oom_calls) if oom_calls else None
    trainer.train()
    return trainer, injector


def rel(a, b):
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a.parameters(), b.parameters()))
    return (num / sum(float(y.pow(2).sum()) for y in b.parameters())) ** 0.5


# forward calls: micro 4 x accumulation 2 -> window 2 holds calls 3 and 4.
@pytest.mark.parametrize("oom_call", [3, 4], ids=["mid-window", "window's-last-forward"])
def test_oom_moves_to_smaller_micro_batch_and_matches_a_clean_run(tmp_path, oom_call, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        hit, injector = run(tmp_path / "oom", micro=4, accum=2, oom_calls=(oom_call,), epochs=2)
    assert injector.count > 0 and "out of memory at step 1" in caplog.text
    clean, _ = run(tmp_path / "clean", micro=2, accum=4, epochs=2)

    assert hit.state.global_step == clean.state.global_step == 8  # optimizer steps unchanged
    assert rel(hit.model, clean.model) <= 1e-10
    # the Trainer sums logged losses in a float32 tensor
    assert logged_losses(hit) == pytest.approx(logged_losses(clean), rel=1e-6)
    # every sample once per epoch: the loop's windows cover the data set exactly, per epoch
    seen = [tuple(r[m.bool()].tolist()) for w in hit.windows for b in w
            for r, m in zip(b["input_ids"], b["attention_mask"])]
    per_epoch = len(seen) // 2
    assert sorted(seen[:per_epoch]) == sorted(seen[per_epoch:]) and len(set(seen[:per_epoch])) == 32
    # the plan in force is the smaller one, effective batch kept, and it is what output_dir holds
    assert hit.plan.to_dict() == {"micro_batch_size": 2, "gradient_accumulation_steps": 4, "world_size": 1,
                                  "target_batch_size": 8}
    assert json.loads((tmp_path / "oom" / PLAN_FILE).read_text())["plan"] == hit.plan.to_dict()
    assert (hit.args.per_device_train_batch_size, hit.args.gradient_accumulation_steps) == (2, 4)


def test_two_ooms_step_down_twice(tmp_path):
    hit, _ = run(tmp_path / "oom", micro=4, accum=2, oom_calls=(3, 5))
    clean, _ = run(tmp_path / "clean", micro=1, accum=8)
    assert hit.plan.micro_batch_size == 1 and hit.state.global_step == clean.state.global_step
    assert rel(hit.model, clean.model) <= 1e-10


def test_micro_batch_one_not_fitting_stops_clearly_with_checkpoints_intact(tmp_path):
    model = tiny_llama()
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=1, target_batch_size=2,
        auto_tune=False, max_steps=4, save_strategy="steps", save_steps=1, report_to=[], use_cpu=True,
        disable_tqdm=True, remove_unused_columns=False,
    )
    trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(16), data_collator=pad_collate)
    OOMAt(model, range(3, 100))  # steps 1 and 2 fit, then no micro-batch does
    with pytest.raises(RuntimeError, match="out of memory at micro-batch 1.*Checkpoints in .* are intact"):
        trainer.train()
    checkpoints = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints and (tmp_path / checkpoints[-1] / "model.safetensors").exists()


def test_eval_oom_re_runs_only_the_failed_eval_batch(tmp_path, caplog):
    """(The metrics equal a clean run's: tests/window/test_evaluation.py.)"""
    model = tiny_llama()
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, target_batch_size=8,
        auto_tune=False, per_device_eval_batch_size=8, max_steps=1, report_to=[], use_cpu=True,
        disable_tqdm=True, remove_unused_columns=False, save_strategy="no",
    )
    trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(16), eval_dataset=lm_examples(16, 9),
                           data_collator=pad_collate)
    OOMAt(model, [1], training=False)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        metrics = trainer.evaluate()
    assert "eval_loss" in metrics and "out of memory in evaluation on a batch of 8" in caplog.text
    assert trainer.args.per_device_eval_batch_size == 8
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)


def tuned(tmp_path, cap, oom_calls=()):
    """A tuned run of target 7 (the plan cuts each window, loaded whole, into near-equal forwards of <= cap)."""
    model = tiny_gpt2()
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), target_batch_size=7, probe_max_micro_batch=cap, num_train_epochs=1,
        learning_rate=1e-2, max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0, disable_tqdm=True, remove_unused_columns=False,
    )
    trainer = recording(AccumTrainer)(model=model, args=args, train_dataset=lm_examples(21, seed=4),
                                      data_collator=pad_collate, compute_loss_func=sum_over_items_loss)
    trainer.remove_callback(PrinterCallback)
    trainer.tune()  # the probe's forwards come before the injector counts
    injector = OOMAt(model, oom_calls) if oom_calls else None
    trainer.train()
    return trainer, injector


def test_oom_in_an_uneven_window_adds_one_forward_and_matches_a_clean_run(tmp_path, caplog):
    # 7 per step where 3 fit: 3 forwards (2 + 2 + 3); an OOM at the 2nd forward of step 2 re-runs that window in
    # 4 forwards of <= 2 (2 + 2 + 2 + 1), the plan a clean run capped at 2 makes from the start
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        hit, injector = tuned(tmp_path / "oom", cap=3, oom_calls=(5,))
    assert injector.count > 0 and "out of memory at step 1" in caplog.text
    clean, _ = tuned(tmp_path / "clean", cap=2)
    core = ("micro_batch_size", "gradient_accumulation_steps", "world_size", "target_batch_size")
    assert ({k: hit.plan.to_dict()[k] for k in core} == {k: clean.plan.to_dict()[k] for k in core}
            == {"micro_batch_size": 2, "gradient_accumulation_steps": 4, "world_size": 1, "target_batch_size": 7})
    # the level chosen is kept (any lever; the loss kernel's measured seconds differ between runs, its record is kept)
    def chosen(plan):
        return {k: (v["kernel"] if k == "loss_kernel" else v) for k, v in (plan.levers or {}).items()}

    assert hit.plan.levers and set(hit.plan.levers) == set(clean.plan.levers)
    assert {k: v for k, v in chosen(hit.plan).items() if k != "loss_kernel"} == \
        {k: v for k, v in chosen(clean.plan).items() if k != "loss_kernel"}
    assert "window 7 × world 1 = 7, 4 forwards of ≤ 2 rows" in caplog.text
    assert hit.state.global_step == clean.state.global_step == 3
    assert rel(hit.model, clean.model) <= 1e-10
