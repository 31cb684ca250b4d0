"""auto_eval_batch_size: the eval batch is the largest whose measured evaluation step fits the budget (found by
search, checked against measuring every size), stored with the plan and reused."""

import json
import logging
import math

import pytest
import torch
from transformers import Trainer

from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.planning.data_scan import example_length as _length
from hf_accum.planning.eval_batch import accumulation_steps, largest_fitting
from hf_accum.planning.store import PLAN_FILE
from hf_accum.probing.meters import CpuMeter, live_tensor_bytes
from hf_accum.probing.plan import Plan
from tests.exactness import lm_examples, pad_collate, tiny_llama


@pytest.mark.parametrize("upper", [1, 2, 7, 16, 40])
@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 5, 8, 13, 16, 17, 100])
def test_largest_fitting_is_the_threshold_within_few_trials(upper, threshold):
    best, trials = largest_fitting(lambda b: b <= threshold, upper)
    assert best == min(threshold, upper)
    assert all(1 <= b <= upper for b, _ in trials) and len({b for b, _ in trials}) == len(trials)
    assert len(trials) <= 2 * math.ceil(math.log2(upper)) + 1


@pytest.mark.parametrize("budget,peak,kept,want", [(100, 40, 0, None), (100, 40, 20, 3), (100, 95, 20, 1),
                                                   (100, 40, 60, 1)])
def test_accumulation_steps_keep_predictions_within_the_budget(budget, peak, kept, want):
    assert accumulation_steps(budget, peak, kept) == want


def eval_set():
    return lm_examples(24, seed=3, min_len=4, max_len=40)


def measured_peaks(model, upper):
    """Every size measured through transformers' own prediction_step (logits kept), outside hf_accum's search."""
    trainer = Trainer(model=model, args=AccumTrainingArguments(output_dir="unused", report_to=[], use_cpu=True,
                                                               remove_unused_columns=False))
    example = max(eval_set(), key=_length)
    meter = CpuMeter(resident=lambda: live_tensor_bytes(model))
    peaks = {}
    model.eval()
    with torch.no_grad():
        for b in range(1, upper + 1):
            batch = pad_collate([example] * b)
            held = []
            m = meter.measure(lambda held=held, batch=batch: held.append(
                Trainer.prediction_step(trainer, model, batch, False)))
            peaks[b] = m.peak_bytes + m.rounding_bytes
    return peaks


def test_the_chosen_eval_batch_is_the_largest_that_fits_and_is_stored(tmp_path, caplog):
    model = tiny_llama(torch.float32)
    peaks = measured_peaks(model, 24)
    assert all(peaks[b] < peaks[b + 4] for b in range(1, 21))  # memory grows with the batch
    budget = (peaks[10] + peaks[11]) // 2  # so the largest that fits is 10
    args = AccumTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True,
                                  remove_unused_columns=False, auto_eval_batch_size=True, memory_budget_bytes=budget,
                                  per_device_eval_batch_size=2)
    trainer = AccumTrainer(model=model, args=args, eval_dataset=eval_set(), data_collator=pad_collate,
                           compute_metrics=lambda p: {"rows": float(len(p.predictions))})
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        metrics = trainer.evaluate()
    largest = max(b for b, p in peaks.items() if p <= budget)
    assert largest == 10 and trainer.args.per_device_eval_batch_size == largest
    assert "eval batch 10 per rank" in caplog.text and metrics["eval_rows"] == 24
    # the value given is named, with how to keep it
    assert "replaces per_device_eval_batch_size=2 (auto_eval_batch_size=False keeps the value given)" in caplog.text
    kept = 10 * 40 * model.config.vocab_size * 4  # the logits of one batch at the longest example
    assert trainer.args.eval_accumulation_steps == max(1, (budget - peaks[10]) // (kept + 10 * 40 * 8))
    assert caplog.text.count("eval batch") == 1
    trainer.evaluate()  # measured once
    assert caplog.text.count("eval batch") == 1


def test_tuned_runs_plan_the_eval_batch_at_the_first_evaluation_and_reuse_it(tmp_path, caplog):
    def run():
        args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=8, max_steps=1, report_to=[],
                                      use_cpu=True, disable_tqdm=True, remove_unused_columns=False, save_strategy="no",
                                      eval_strategy="steps", eval_steps=1, memory_budget_bytes=64 * 2**20)
        trainer = AccumTrainer(model=tiny_llama(torch.float32), args=args, train_dataset=lm_examples(16),
                               eval_dataset=eval_set(), data_collator=pad_collate)
        trainer.train()
        return trainer

    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        first = run()
    assert first.plan.eval_batch_size == first.args.per_device_eval_batch_size == 24  # the whole set fits
    assert "; eval batch 24" in first.plan.describe()
    stored = json.loads((tmp_path / PLAN_FILE).read_text())["plan"]
    assert stored["eval_batch_size"] == 24
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        second = run()
    assert "stored plan (reused " in caplog.text and "eval batch 24 per rank" not in caplog.text
    assert second.args.per_device_eval_batch_size == 24


def test_a_plan_without_an_eval_batch_keeps_its_four_fields():
    assert Plan(4, 2, 1, 8).to_dict() == {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "world_size": 1,
                                          "target_batch_size": 8}
    assert Plan(4, 2, 1, 8, eval_batch_size=16).to_dict()["eval_batch_size"] == 16


def test_planning_the_eval_batch_on_a_reused_plan_keeps_its_probe_record(tmp_path, caplog):
    """The plan file a run reused is rewritten with the eval batch, and still holds what the probe measured."""
    def run(evaluates):
        args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=8, max_steps=1, report_to=[],
                                      use_cpu=True, disable_tqdm=True, remove_unused_columns=False, save_strategy="no",
                                      eval_strategy="steps" if evaluates else "no", eval_steps=1,
                                      memory_budget_bytes=64 * 2**20)
        trainer = AccumTrainer(model=tiny_llama(torch.float32), args=args, train_dataset=lm_examples(16),
                               eval_dataset=eval_set(), data_collator=pad_collate)
        trainer.train()
        return json.loads((tmp_path / PLAN_FILE).read_text())

    probed = run(evaluates=False)
    assert probed["probe"] and probed["probe"]["trials"] and "eval_batch_size" not in probed["plan"]
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        reused = run(evaluates=True)
    assert "stored plan (reused " in caplog.text and "eval batch 24 per rank" in caplog.text
    assert reused["plan"]["eval_batch_size"] == 24
    assert reused["probe"] == probed["probe"] and reused["key"] == probed["key"]
