"""The training data against the target, before any heavy work: a set smaller than the effective batch, an empty
set and causal-LM labels that do not align with input_ids are refused with the argument and the fix, and nothing
(weights, probe, optimizer step) has run."""

import pytest
import torch

from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.tiny import SFTCollator, build_model, build_sft_dataset
from tests.exactness import lm_examples, pad_collate, tiny_llama

MiB = 2**20


def tuned(tmp_path, tok, rows, **kw):
    args = AccumTrainingArguments(output_dir=str(tmp_path), memory_budget_bytes=8 * MiB, use_cpu=True, report_to=[],
                                  num_train_epochs=1, save_strategy="no", disable_tqdm=True, **kw)
    return AccumTrainer(model=build_model(tokenizer=tok), args=args, train_dataset=build_sft_dataset(rows, tok),
                        data_collator=SFTCollator(tok))


def refused(trainer, message):
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0 and trainer.probe_result is None and trainer.plan is None
    assert all(torch.equal(p, w) for p, w in zip(trainer.model.parameters(), before))


@pytest.mark.parametrize(
    "rows,target,fix",
    [(20, 32, "Set target_batch_size to at most 20"), (64, 128, "Set target_batch_size to at most 64"),
     (64, 10**9, "Set target_batch_size to at most 64")],
)
def test_a_target_larger_than_the_training_set_is_refused(tmp_path, tok, rows, target, fix):
    trainer = tuned(tmp_path, tok, rows, target_batch_size=target)
    assert len(trainer.train_dataset) == rows
    refused(trainer, rf"target_batch_size={target} is larger than the training set \({rows} rows\): every optimizer "
                     rf"step would use the whole epoch, {rows} samples, not {target}\. {fix}, or add training data\.")


def test_without_the_tuner_too(tmp_path, tok):
    trainer = tuned(tmp_path, tok, 20, target_batch_size=32, auto_tune=False, per_device_train_batch_size=4,
                    gradient_accumulation_steps=8)
    refused(trainer, "target_batch_size=32 is larger than the training set")


def test_a_target_the_training_set_holds_trains(tmp_path, tok):
    trainer = tuned(tmp_path, tok, 20, target_batch_size=20, auto_tune=False, per_device_train_batch_size=4,
                    gradient_accumulation_steps=5)
    trainer.train()
    assert trainer.state.global_step == 1


def test_an_empty_training_set_is_refused(tmp_path, tok):
    trainer = tuned(tmp_path, tok, 48, target_batch_size=16)
    trainer.train_dataset = []
    refused(trainer, r"train_dataset is empty \(0 rows\): there is nothing to train on\. Pass a training set with "
                     r"at least 16 rows")


def test_causal_lm_labels_that_do_not_align_with_input_ids_are_refused(tmp_path):
    rows = lm_examples(8, seed=1)
    rows[5] = {"input_ids": rows[5]["input_ids"], "labels": rows[5]["labels"] + [7, 7]}  # one row off by two
    args = AccumTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                                  remove_unused_columns=False)
    trainer = AccumTrainer(model=tiny_llama(torch.float32), args=args, train_dataset=rows, data_collator=pad_collate)
    refused(trainer, rf"train_dataset row 5: labels has {len(rows[5]['labels'])} entries but input_ids "
                     rf"{len(rows[5]['input_ids'])}\. A causal LM shifts labels itself")


def test_a_hf_dataset_is_read_in_batches(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = lm_examples(8, seed=1)
    rows[6]["labels"] = rows[6]["labels"][:-1]
    data = datasets.Dataset.from_list(rows)
    args = AccumTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                                  remove_unused_columns=False)
    trainer = AccumTrainer(model=tiny_llama(torch.float32), args=args, train_dataset=data, data_collator=pad_collate)
    refused(trainer, "train_dataset row 6: labels has")
