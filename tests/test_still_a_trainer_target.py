"""With `AccumTrainingArguments` (a target or not) our trainer still looks like transformers' `Trainer` from the
outside: its callback list is the Trainer's (grow-back, step control and the plan in checkpoints are Trainer
methods, not callbacks), `log_history` and the `on_log` events are the Trainer's entries (the plan's figures ride
on the first one), a resumed run's history equals the uninterrupted run's, and the arguments after training equal
what was given (transformers' `test_default_callbacks_are_present`, `test_event_flow`, `test_can_resume_training`,
`test_training_arguments_are_left_untouched` failed with a target set)."""

import json
import math
import os

import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.planning.store import PLAN_FILE

from .exactness import lm_examples, pad_collate, tiny_llama

RUN = dict(per_device_train_batch_size=4, report_to=[], use_cpu=True, disable_tqdm=True,
           remove_unused_columns=False, seed=0)
TIMES = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "eval_runtime",
         "eval_samples_per_second", "eval_steps_per_second"}


def ours_args(tmp_path, **kw):
    # the target the batch settings already imply (4 x 1 x 1): the plan must come out the same
    return AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=4, probe_max_micro_batch=2,
                                  memory_budget_bytes=1 << 30, **{**RUN, **kw})


class Events(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            self.events.append(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("target", [None, 4])
def test_the_callback_list_is_the_trainers(tmp_path, target):
    data = lm_examples(8)
    args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=target, **RUN)
    ours = AccumTrainer(model=tiny_llama(), args=args, train_dataset=data, data_collator=pad_collate)
    theirs = Trainer(model=tiny_llama(), args=TrainingArguments(output_dir=str(tmp_path), **RUN), train_dataset=data,
                     data_collator=pad_collate)
    assert [type(c) for c in ours.callback_handler.callbacks] == [type(c) for c in theirs.callback_handler.callbacks]


def test_log_history_and_events_are_the_trainers_with_the_figures_on_the_first_entry(tmp_path, capsys):
    data = lm_examples(16)
    kw = dict(max_steps=3, logging_steps=1, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4,
              save_strategy="no")
    runs = {}
    for name, cls, args in [("theirs", Trainer, TrainingArguments(output_dir=str(tmp_path / "t"), **RUN, **kw)),
                            ("ours", AccumTrainer, ours_args(tmp_path / "o", auto_eval_batch_size=False, **kw))]:
        events = Events()
        trainer = cls(model=tiny_llama(), args=args, train_dataset=data, eval_dataset=data[:8],
                      data_collator=pad_collate, callbacks=[events])
        trainer.train()
        runs[name] = (trainer, events.events)
    ours, theirs = runs["ours"][0], runs["theirs"][0]
    assert ours.plan.describe().startswith("micro 2 × accumulation 2 × world 1 = 4") and ours.probe_result
    assert runs["ours"][1] == runs["theirs"][1]  # no on_log (or any other event) of our own
    figures = {k for k in ours.state.log_history[0] if k.startswith("hf_accum/")}
    assert "hf_accum/micro_batch_size" in figures and ours.state.log_history[0]["hf_accum/micro_batch_size"] == 2
    assert all(not k.startswith("hf_accum/") for h in ours.state.log_history[1:] for k in h)
    assert [sorted(set(h) - figures) for h in ours.state.log_history] == [sorted(h) for h in theirs.state.log_history]
    assert "loss" in ours.state.log_history[0] and "eval_loss" in ours.state.log_history[2]
    assert "hf_accum/micro_batch_size" not in capsys.readouterr().out  # recorded, not printed (the plan line was)


def test_a_resumed_run_has_the_uninterrupted_runs_log_history(tmp_path):
    data = lm_examples(24)
    kw = dict(max_steps=6, logging_steps=1, save_strategy="steps", save_steps=3)
    whole = AccumTrainer(model=tiny_llama(), args=ours_args(tmp_path / "a", **kw), train_dataset=data,
                         data_collator=pad_collate)
    whole.train()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert (checkpoint / PLAN_FILE).exists()  # the plan still goes with every checkpoint
    resumed = AccumTrainer(model=tiny_llama(), args=ours_args(tmp_path / "a", **kw), train_dataset=data,
                           data_collator=pad_collate)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    def without_times(history):
        return [{k: v for k, v in h.items() if k not in TIMES} for h in history]

    got, want = without_times(resumed.state.log_history), without_times(whole.state.log_history)
    assert len(got) == len(want) and got[0] == want[0]
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        assert all(math.isclose(g[k], w[k], rel_tol=1e-9) for k in g), (g, w)


def test_a_run_resumed_from_a_checkpoint_saved_before_any_log_entry_has_the_uninterrupted_runs_log_history(tmp_path):
    # logging_steps's default (500): checkpoint-3's history is empty, so the resumed run's one entry carries the
    # figures of the run that wrote the checkpoint (plan_reused 0, its check), not its own (plan_reused 1)
    data = lm_examples(24)
    kw = dict(max_steps=6, save_strategy="steps", save_steps=3, check_accumulation=True)
    whole = AccumTrainer(model=tiny_llama(), args=ours_args(tmp_path / "a", **kw), train_dataset=data,
                         data_collator=pad_collate)
    whole.train()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["log_history"] == []
    resumed = AccumTrainer(model=tiny_llama(), args=ours_args(tmp_path / "a", **kw), train_dataset=data,
                           data_collator=pad_collate)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.planner.figures["hf_accum/plan_reused"] == 1  # its own plan was the stored one

    got = [{k: v for k, v in h.items() if k not in TIMES} for h in resumed.state.log_history]
    want = [{k: v for k, v in h.items() if k not in TIMES} for h in whole.state.log_history]
    assert len(want) == 1 and want[0]["hf_accum/plan_reused"] == 0 and "accumulation_check_relative_error" in want[0]
    assert got == want


def test_the_arguments_after_training_equal_the_arguments_given(tmp_path):
    kw = dict(max_steps=2, save_strategy="no")
    trainer = AccumTrainer(model=tiny_llama(), args=ours_args(tmp_path, **kw), train_dataset=lm_examples(16),
                           data_collator=pad_collate)
    trainer.train()
    fresh, got = ours_args(tmp_path, **kw).to_dict(), trainer.args.to_dict()
    assert got["max_nonfinite_steps"] == "auto" and trainer._nonfinite_limit == 3  # resolved on the trainer
    assert {k: got[k] for k in fresh if k != "logging_dir"} == {k: v for k, v in fresh.items() if k != "logging_dir"}
    assert os.path.isdir(tmp_path)
