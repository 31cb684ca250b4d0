"""Stop and resume: the same trajectory as a run never stopped, the plan in force restored, and a checkpoint
from another target batch refused (float64, CPU)."""

import pytest
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2
from tests.trainer.test_oom_recovery import OOMAt, rel


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


def trainer_for(out, micro=2, accum=4, stop=None, oom=(), **kw):
    model = tiny_gpt2()
    args = AccumTrainingArguments(
        output_dir=str(out), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        target_batch_size=kw.pop("target", micro * accum), auto_tune=False, num_train_epochs=2, learning_rate=1e-2,
        max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        remove_unused_columns=False, logging_steps=1, **kw,
    )
    trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(40, seed=6), data_collator=pad_collate,
                           compute_loss_func=sum_over_items_loss, callbacks=[StopAt(stop)] if stop else [])
    trainer.remove_callback(PrinterCallback)
    if oom:
        OOMAt(model, oom)
    return trainer


def test_stop_and_resume_follows_the_uninterrupted_trajectory(tmp_path):
    full = trainer_for(tmp_path / "full")
    full.train()
    first = trainer_for(tmp_path / "split", stop=3)
    first.train()
    assert first.state.global_step == 3
    resumed = trainer_for(tmp_path / "split")
    resumed.train(resume_from_checkpoint=str(tmp_path / "split" / "checkpoint-3"))
    assert resumed.state.global_step == full.state.global_step == 10  # 40 samples / 8 per step x 2 epochs
    assert rel(resumed.model, full.model) <= 1e-10


def test_resume_restores_the_downgraded_plan(tmp_path):
    # An OOM at step 1 moved the run from micro 4 to micro 2; the checkpoint at step 3 carries that plan.
    first = trainer_for(tmp_path / "run", micro=4, accum=2, stop=3, oom=(3,))
    first.train()
    assert first.plan.micro_batch_size == 2
    resumed = trainer_for(tmp_path / "run", micro=4, accum=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert resumed.plan.to_dict() == first.plan.to_dict()
    assert resumed.args.per_device_train_batch_size == 2 and resumed.state.global_step == 10
    clean = trainer_for(tmp_path / "clean", micro=2, accum=4)
    clean.train()
    assert rel(resumed.model, clean.model) <= 1e-10


def test_resume_with_another_target_is_an_error(tmp_path):
    trainer_for(tmp_path / "run", stop=2).train()
    other = trainer_for(tmp_path / "run", micro=2, accum=2)
    weights = [p.detach().clone() for p in other.model.parameters()]
    with pytest.raises(ValueError, match="holds a run trained with target_batch_size=8, but target_batch_size=4 now"):
        other.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert all((p == w).all() for p, w in zip(other.model.parameters(), weights))


def test_output_dir_holding_a_run_with_another_target_is_an_error(tmp_path):
    trainer_for(tmp_path / "run", stop=2).train()
    with pytest.raises(ValueError, match="start the new run in another output_dir"):
        trainer_for(tmp_path / "run", micro=2, accum=2).train()
