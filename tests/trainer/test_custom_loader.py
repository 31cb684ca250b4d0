"""A Trainer subclass may return its own iterable from `get_train_dataloader` (transformers'
`test_dataloader_without_dataset` does): the checks before the probe read the batches it yields, or skip with
one log line, and never crash on a missing `.dataset`."""

import logging

import pytest
import torch

from hf_accum import AccumTrainer, AccumTrainingArguments
from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_llama


class MultiLoader:  # as transformers' tests/trainer/test_trainer.py: no .dataset, no .collate_fn
    def __init__(self, loaders):
        self.loaders = loaders

    def __len__(self):
        return sum(len(loader) for loader in self.loaders)

    def __iter__(self):
        for loader in self.loaders:
            yield from loader


class TwiceTrainer(AccumTrainer):
    def get_train_dataloader(self):
        return MultiLoader([super().get_train_dataloader(), super().get_train_dataloader()])


def trainer_for(tmp_path, rows):
    args = AccumTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                                  remove_unused_columns=False)
    return TwiceTrainer(model=tiny_llama(torch.float32), args=args, train_dataset=rows, data_collator=pad_collate)


def test_a_loader_without_dataset_trains(tmp_path):
    trainer = trainer_for(tmp_path, lm_examples(8, seed=1))
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_loader_without_dataset_is_read_for_the_label_check(tmp_path):
    rows = lm_examples(8, seed=1)
    for row in rows:
        row["labels"] = [-100] * len(row["labels"])
    trainer = trainer_for(tmp_path, rows)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match="Every label of the training set is ignored"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, w) for p, w in zip(trainer.model.parameters(), before))


class Endless:  # no length: it cannot be read ahead
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        while True:
            yield from self.loader


class EndlessTrainer(AccumTrainer):
    def get_train_dataloader(self):
        return Endless(super().get_train_dataloader())


def test_a_loader_that_cannot_be_read_ahead_is_skipped_with_one_line(tmp_path, caplog):
    rows = lm_examples(8, seed=1)
    args = AccumTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                                  remove_unused_columns=False)
    trainer = EndlessTrainer(model=tiny_llama(torch.float32), args=args, train_dataset=rows, data_collator=pad_collate)
    from hf_accum.trainer.checks import preflight

    with caplog.at_level(logging.INFO, logger=preflight.__name__):
        preflight.check_training_data(trainer)
    lines = [r.getMessage() for r in caplog.records if r.name == preflight.__name__]
    assert len(lines) == 1 and "Endless" in lines[0] and "not checked" in lines[0]


class EvalTwiceTrainer(AccumTrainer):
    def get_eval_dataloader(self, eval_dataset=None):
        return MultiLoader([super().get_eval_dataloader(eval_dataset)] * 2)


@pytest.mark.parametrize("target", [None, 8])
def test_an_eval_loader_without_dataset_keeps_the_eval_batch_and_the_exact_eval_loss(tmp_path, caplog, target):
    """The eval batch is not planned on a loader without `.dataset` (one line says why); eval_loss stays the exact
    token mean over what the loader yields (the eval set twice: the same mean), target or not."""
    from tests.window.test_evaluation import eval_data, eval_model, reference

    model = eval_model()
    args = AccumTrainingArguments(output_dir=str(tmp_path), target_batch_size=target, per_device_eval_batch_size=3,
                                  use_cpu=True, report_to=[], disable_tqdm=True, remove_unused_columns=False)
    trainer = EvalTwiceTrainer(model=model, args=args, train_dataset=lm_examples(8, seed=1), eval_dataset=eval_data(),
                               data_collator=pad_collate, compute_loss_func=sum_over_items_loss)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        got = trainer.evaluate()["eval_loss"]
    assert abs(got - reference(model, eval_data())) <= 1e-12
    assert trainer.args.per_device_eval_batch_size == 3
    skipped = "get_eval_dataloader() returned a MultiLoader without .dataset" in caplog.text
    assert skipped == (target is not None) and "eval batch 3" not in caplog.text
