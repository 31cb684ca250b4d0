"""`AccumTrainer` stays a `Trainer`: the arguments object the caller passed is never written to, plain
`TrainingArguments` add no callback, and `del trainer` frees the model without a garbage-collector pass (each of
these failed transformers' own Trainer tests with `Trainer` swapped for `AccumTrainer`)."""

import gc
import weakref

import pytest
from transformers import Trainer, TrainingArguments

from hf_accum import AccumTrainer, AccumTrainingArguments

from .exactness import lm_examples, pad_collate, tiny_llama


def plain_args(tmp_path, max_steps=2):
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=max_steps,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False)


def test_training_leaves_plain_arguments_as_a_fresh_object_has_them(tmp_path):
    trainer = AccumTrainer(model=tiny_llama(), args=plain_args(tmp_path), train_dataset=lm_examples(16),
                           data_collator=pad_collate)
    trainer.train()
    fresh = plain_args(tmp_path).to_dict()
    got = trainer.args.to_dict()
    assert {k: got[k] for k in fresh if k != "logging_dir"} == {k: v for k, v in fresh.items() if k != "logging_dir"}


def test_the_callers_arguments_are_never_written_to(tmp_path):
    args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=8, probe_max_micro_batch=2,
                                  max_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                  remove_unused_columns=False, memory_budget_bytes=1 << 30)
    before = args.to_dict()
    trainer = AccumTrainer(model=tiny_llama(), args=args, train_dataset=lm_examples(16), data_collator=pad_collate)
    trainer.train()
    assert trainer.plan.describe().startswith("micro 2 × accumulation 4 × world 1 = 8")
    # our copy loads each window whole (the engine cuts it into the plan's forwards)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 1)
    assert args.to_dict() == before and trainer.args is not args


def test_plain_arguments_add_no_callback(tmp_path):
    data = lm_examples(8)
    ours = AccumTrainer(model=tiny_llama(), args=plain_args(tmp_path), train_dataset=data, data_collator=pad_collate)
    theirs = Trainer(model=tiny_llama(), args=plain_args(tmp_path), train_dataset=data, data_collator=pad_collate)
    assert [type(c) for c in ours.callback_handler.callbacks] == [type(c) for c in theirs.callback_handler.callbacks]


@pytest.mark.parametrize("with_target", [False, True])
def test_deleting_the_trainer_frees_the_model_without_gc(tmp_path, with_target):
    model = tiny_llama()
    alive = weakref.ref(model)
    args = (AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=4, auto_tune=False,
                                   per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
                                   save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
            if with_target else plain_args(tmp_path, max_steps=1))
    trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(8), data_collator=pad_collate)
    trainer.train()
    gc.collect()
    gc.disable()
    try:
        del trainer, model
        assert alive() is None, "something still holds the trainer (a reference cycle)"
    finally:
        gc.enable()


def test_resuming_a_missing_checkpoint_gives_transformers_own_errors(tmp_path):
    # transformers' test_can_resume_training asserts these messages; hf_accum raises them before any work, in
    # transformers' words with the fix added
    args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=4, auto_tune=False,
                                  per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
                                  save_strategy="no", disable_tqdm=True, remove_unused_columns=False)
    trainer = AccumTrainer(model=tiny_llama(), args=args, train_dataset=lm_examples(8), data_collator=pad_collate)
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-15-bogus"))
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)
