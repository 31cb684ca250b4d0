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
from hf_accum.planning.store import PLAN_FILE, restore_plan
from hf_accum.trainer.resilience.checkpoints import inspect_checkpoint, newest_complete_checkpoint
from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2
from tests.trainer.test_oom_recovery import rel

# One xdist worker runs these tests (--dist loadgroup): `run` and `weights_only_run` are built once, not on each.
pytestmark = pytest.mark.xdist_group("test_checkpoints")


class SaveAt(TrainerCallback):
    def __init__(self, saves=(), stop=None):
        self.saves, self.stop = set(saves), stop

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.saves or state.global_step == self.stop:
            control.should_save = True
        if state.global_step == self.stop:
            control.should_training_stop = True


def trainer_for(out, micro=2, accum=4, saves=(), stop=None, plain=False, model=None, **kw):
    common = dict(output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                  num_train_epochs=2, learning_rate=1e-2, max_grad_norm=0.0, report_to=[], save_strategy="no",
                  use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False, logging_steps=1)
    if plain:
        args = TrainingArguments(**common)
    else:
        args = AccumTrainingArguments(target_batch_size=kw.pop("target", micro * accum), auto_tune=False, **common,
                                      **kw)
    cls = Trainer if plain == "transformers" else AccumTrainer
    trainer = cls(model=model or tiny_gpt2(), args=args, train_dataset=lm_examples(40, seed=6), data_collator=pad_collate,
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


@pytest.mark.parametrize("how", ["no_trainer_state", "truncated_trainer_state", "missing", "weights_only"])
def test_true_resumes_the_newest_complete_checkpoint_and_says_which(run, tmp_path, caplog, how):
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    state = out / "checkpoint-4" / "trainer_state.json"
    if how == "no_trainer_state":
        state.unlink()
    elif how == "truncated_trainer_state":
        state.write_text(state.read_text()[:100])
    elif how == "weights_only":  # what save_only_model=True writes (a run that switched it on after step 2)
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            (out / "checkpoint-4" / name).unlink()
    else:
        (out / "checkpoint-4" / PLAN_FILE).unlink()
    assert newest_complete_checkpoint(str(out)) == str(out / "checkpoint-2")
    resumed = trainer_for(out)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        resumed.train(resume_from_checkpoint=True)
    assert f"resuming from {out / 'checkpoint-2'}, the newest complete checkpoint" in caplog.text
    assert f"skipping {out / 'checkpoint-4'}: " in caplog.text
    assert resumed.state.global_step == 10 and rel(resumed.model, run[1]) <= 1e-10


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng_state.pth", "config.json"])
def test_true_skips_a_checkpoint_with_a_truncated_file_and_resumes_exactly(run, tmp_path, caplog, name):
    """A copy cut short or a full disk: transformers would pick checkpoint-4 and fail in a loader's traceback (or
    quietly lose the RNG state); the newest checkpoint that loads is checkpoint-2, and the resume is exact."""
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    truncate(out / "checkpoint-4" / name)
    resumed = trainer_for(out)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        resumed.train(resume_from_checkpoint=True)
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].startswith(f"hf_accum: skipping {out / 'checkpoint-4'}: its file {name}: ")
    assert f"resuming from {out / 'checkpoint-2'}, the newest complete checkpoint" in caplog.text
    assert resumed.state.global_step == 10 and rel(resumed.model, run[1]) <= 1e-10


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_a_truncated_checkpoint_given_by_path_names_the_file_and_the_newest_good_one(run, tmp_path, name):
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    truncate(out / "checkpoint-4" / name, keep=0.9)
    other = trainer_for(out)
    before = weights(other)
    with pytest.raises(ValueError) as info:
        other.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"Cannot resume from {out / 'checkpoint-4'}: its file {name}: ")
    assert f"resume from {out / 'checkpoint-2'}, the newest complete checkpoint" in message
    assert unchanged(other, before) and other.state.global_step == 0


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


# --- checkpoints without optimizer state (save_only_model=True) ------------------------------------------------------
# transformers resumes them with a fresh optimizer and schedule without a word (tests/compat/test_compat.py pins that).
@pytest.fixture(scope="module")
def weights_only_run(tmp_path_factory):
    """A save_only_model=True run stopped at step 4, with (weights-only) checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("weights_only") / "run"
    trainer_for(out, saves=(2,), stop=4, save_only_model=True).train()
    return out


def test_a_save_only_model_checkpoint_is_refused_before_any_training(weights_only_run):
    ckpt = weights_only_run / "checkpoint-4"
    assert not {"optimizer.pt", "scheduler.pt"} & set(os.listdir(ckpt))  # what the refusal is about
    info = inspect_checkpoint(str(ckpt))
    assert not info.complete and info.plan is not None and info.target_batch_size == 8
    resumed = trainer_for(weights_only_run, save_only_model=True)
    before = weights(resumed)
    with pytest.raises(ValueError) as raised:
        resumed.train(resume_from_checkpoint=str(ckpt))
    message = str(raised.value)
    assert message.startswith(f"Cannot resume from {ckpt}: it holds no optimizer or scheduler state (it was saved "
                              "with save_only_model=True): resuming it would restart the optimizer's state (AdamW's "
                              "moments) and the learning-rate schedule. To go on: ")
    assert "resume from a checkpoint saved without save_only_model" in message
    assert f"from_pretrained({str(ckpt)!r}) as the model, in another output_dir" in message
    assert "\n" not in message and "restore_plan" not in message
    assert unchanged(resumed, before) and resumed.state.global_step == 0 and resumed.optimizer is None


def test_true_over_only_save_only_model_checkpoints_is_refused_naming_each(weights_only_run):
    resumed = trainer_for(weights_only_run)
    before = weights(resumed)
    with pytest.raises(ValueError) as raised:
        resumed.train(resume_from_checkpoint=True)
    message = str(raised.value)
    assert message.startswith(f"resume_from_checkpoint=True, but {weights_only_run} holds no complete checkpoint.")
    for step in (4, 2):
        assert f"{weights_only_run / f'checkpoint-{step}'}: it holds no optimizer or scheduler state" in message
    assert f"from the weights of {weights_only_run / 'checkpoint-4'} with from_pretrained(" in message
    assert unchanged(resumed, before) and resumed.state.global_step == 0


def test_an_explicit_weights_only_checkpoint_points_to_the_older_complete_one(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    for name in ("optimizer.pt", "scheduler.pt"):
        (out / "checkpoint-4" / name).unlink()
    other = trainer_for(out, micro=2, accum=2)  # target 4, the run had 8
    with pytest.raises(ValueError) as raised:
        other.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    message = str(raised.value)
    assert message.startswith(f"Cannot resume from {out / 'checkpoint-4'}: it holds no optimizer or scheduler state: ")
    assert f"resume from {out / 'checkpoint-2'}, the newest complete checkpoint" in message
    assert "saved without save_only_model" not in message  # the older one is the way
    assert message.endswith("To resume, set target_batch_size=8 (the run's), not 4.")


def test_a_new_run_from_a_weights_only_checkpoint_starts_from_its_weights(weights_only_run, tmp_path):
    from transformers import GPT2LMHeadModel

    ckpt = weights_only_run / "checkpoint-4"
    new = trainer_for(tmp_path / "new", model=GPT2LMHeadModel.from_pretrained(ckpt, dtype=torch.float64))
    stopped = weights(new)
    assert not unchanged(trainer_for(tmp_path / "fresh"), stopped)  # the checkpoint's weights, not a fresh model's
    new.train()
    assert new.state.global_step == 10 and not unchanged(new, stopped)  # a new run: from step 0


@pytest.mark.parametrize("deepspeed,complete", [(True, True), (None, True), (False, False)])
def test_deepspeed_optimizer_state_counts_for_a_deepspeed_run(run, tmp_path, deepspeed, complete):
    # DeepSpeed's engine keeps the optimizer and scheduler in global_stepN/ (no optimizer.pt, no scheduler.pt)
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    for name in ("optimizer.pt", "scheduler.pt"):
        (out / "checkpoint-4" / name).unlink()
    (out / "checkpoint-4" / "global_step4").mkdir()
    info = inspect_checkpoint(str(out / "checkpoint-4"), deepspeed=deepspeed)
    assert info.complete is complete
    if not complete:
        assert info.problem.startswith("its optimizer state is DeepSpeed's (a global_step* folder), which this run "
                                       "without DeepSpeed would not load")
    # and a plain checkpoint is not one a DeepSpeed run loads (transformers would raise later, after loading)
    assert inspect_checkpoint(str(run[0] / "checkpoint-4"), deepspeed=True).complete is False
    assert inspect_checkpoint(str(run[0] / "checkpoint-4"), deepspeed=False).complete


def test_a_save_only_model_runs_stop_advice_is_a_new_run_not_a_resume(tmp_path):
    trainer = trainer_for(tmp_path / "run", save_only_model=True)
    advice = trainer._resume_advice("CKPT")
    assert "cannot be resumed" in advice and "from_pretrained(CHECKPOINT)" in advice
    assert "resume_from_checkpoint" not in advice
    assert "resume_from_checkpoint='CKPT'" in trainer_for(tmp_path / "full")._resume_advice("CKPT")
