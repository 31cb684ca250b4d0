"""Checkpoints and their plans: a checkpoint without a readable plan is never resumed at another (or an unknown)
target; `resume_from_checkpoint=True` takes the newest *complete* checkpoint and says which; plain `Trainer`
checkpoints stay resumable (float64, CPU)."""

import json
import logging
import os
import shutil

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.checkpoints import inspect_checkpoint, newest_complete_checkpoint, restore_plan
from hf_accum.plan_store import PLAN_FILE

from .exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2
from .test_oom_recovery import rel


class SaveAt(TrainerCallback):
    def __init__(self, saves=(), stop=None):
        self.saves, self.stop = set(saves), stop

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.saves or state.global_step == self.stop:
            control.should_save = True
        if state.global_step == self.stop:
            control.should_training_stop = True


def trainer_for(out, micro=2, accum=4, saves=(), stop=None, plain=False, **kw):
    common = dict(output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                  num_train_epochs=2, learning_rate=1e-2, max_grad_norm=0.0, report_to=[], save_strategy="no",
                  use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False, logging_steps=1)
    if plain:
        args = TrainingArguments(**common)
    else:
        args = AccumTrainingArguments(target_batch_size=kw.pop("target", micro * accum), auto_tune=False, **common,
                                      **kw)
    cls = Trainer if plain == "transformers" else AccumTrainer
    trainer = cls(model=tiny_gpt2(), args=args, train_dataset=lm_examples(40, seed=6), data_collator=pad_collate,
                  compute_loss_func=sum_over_items_loss, callbacks=[SaveAt(saves, stop)])
    trainer.remove_callback(PrinterCallback)
    return trainer


def weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def unchanged(trainer, before):
    return all(torch.equal(p, w) for p, w in zip(trainer.model.parameters(), before))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run stopped at step 4 with checkpoints at steps 2 and 4, and the uninterrupted run's model."""
    root = tmp_path_factory.mktemp("ckpt")
    trainer_for(root / "run", saves=(2,), stop=4).train()
    full = trainer_for(root / "full")
    full.train()
    return root / "run", full.model


def damaged(run, tmp_path, how):
    """A copy of the stopped run whose newest checkpoint lost its plan (``missing``: a kill between transformers'
    trainer_state.json and the plan write) or holds a corrupt one."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    plan = out / "checkpoint-4" / PLAN_FILE
    if how == "missing":
        plan.unlink()
    else:
        plan.write_text('{"plan": {"micro_batch_size": 2, "gradient_accumul')
    return out


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_a_checkpoint_without_a_readable_plan_is_not_resumed_at_another_target(run, tmp_path, how):
    out = damaged(run[0], tmp_path, how)
    other = trainer_for(out, micro=2, accum=2)  # target 4, the run had 8
    before = weights(other)
    with pytest.raises(ValueError) as info:
        other.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    message = str(info.value)
    assert message.startswith(f"Cannot resume from {out / 'checkpoint-4'}: its plan file")
    assert message.endswith("Whichever way, resume with target_batch_size=8 (the run's), not 4.")
    assert f"resume from {out / 'checkpoint-2'}, the newest complete checkpoint" in message
    assert unchanged(other, before) and other.state.global_step == 0


def test_a_lost_plan_is_refused_with_the_way_out_and_the_way_out_resumes_exactly(run, tmp_path):
    out = damaged(run[0], tmp_path, "missing")
    same = trainer_for(out)
    with pytest.raises(ValueError, match=r"is missing, although the run had target_batch_size=8.*restore_plan\("):
        same.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    plan = restore_plan(str(out / "checkpoint-4"))
    assert plan.describe() == "micro 2 × accumulation 4 × world 1 = 8"
    resumed = trainer_for(out)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert resumed.state.global_step == 10 and rel(resumed.model, run[1]) <= 1e-10


def test_a_corrupt_plan_file_is_named(run, tmp_path):
    out = damaged(run[0], tmp_path, "corrupt")
    with pytest.raises(ValueError, match=f"{out / 'checkpoint-4' / PLAN_FILE} cannot be read as JSON"):
        trainer_for(out).train(resume_from_checkpoint=str(out / "checkpoint-4"))


@pytest.mark.parametrize("how", ["no_trainer_state", "truncated_trainer_state", "missing"])
def test_true_resumes_the_newest_complete_checkpoint_and_says_which(run, tmp_path, caplog, how):
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    state = out / "checkpoint-4" / "trainer_state.json"
    if how == "no_trainer_state":
        state.unlink()
    elif how == "truncated_trainer_state":
        state.write_text(state.read_text()[:100])
    else:
        (out / "checkpoint-4" / PLAN_FILE).unlink()
    assert newest_complete_checkpoint(str(out)) == str(out / "checkpoint-2")
    resumed = trainer_for(out)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        resumed.train(resume_from_checkpoint=True)
    assert f"resuming from {out / 'checkpoint-2'}, the newest complete checkpoint" in caplog.text
    assert f"skipping {out / 'checkpoint-4'}: " in caplog.text
    assert resumed.state.global_step == 10 and rel(resumed.model, run[1]) <= 1e-10


def test_true_without_a_complete_checkpoint_says_why(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    for step in (2, 4):
        (out / f"checkpoint-{step}" / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True, but .* holds no complete checkpoint\. .*"
                                         r"checkpoint-4: trainer_state.json is missing"):
        trainer_for(out).train(resume_from_checkpoint=True)


def test_plain_trainer_checkpoints_stay_resumable(tmp_path):
    trainer_for(tmp_path / "run", plain="transformers", saves=(2,), stop=4).train()
    assert inspect_checkpoint(str(tmp_path / "run" / "checkpoint-4")).complete
    assert newest_complete_checkpoint(str(tmp_path / "run")) == str(tmp_path / "run" / "checkpoint-4")
    resumed = trainer_for(tmp_path / "run", plain=True)
    resumed.train(resume_from_checkpoint=True)
    full = trainer_for(tmp_path / "full", plain=True)
    full.train()
    assert resumed.state.global_step == 10 and rel(resumed.model, full.model) <= 1e-10


def test_the_plan_in_each_checkpoint_is_the_runs(run):
    for step in (2, 4):
        info = inspect_checkpoint(str(run[0] / f"checkpoint-{step}"))
        assert info.complete and info.target_batch_size == 8
        assert json.loads((run[0] / f"checkpoint-{step}" / PLAN_FILE).read_text())["plan"]["target_batch_size"] == 8


def test_newest_complete_checkpoint_of_an_empty_or_absent_dir(tmp_path):
    assert newest_complete_checkpoint(str(tmp_path / "absent")) is None
    os.makedirs(tmp_path / "checkpoint-7")  # a folder transformers had only begun to write
    assert newest_complete_checkpoint(str(tmp_path)) is None
