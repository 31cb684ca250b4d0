"""The probe's batch is one the user's collator takes, whatever the data (issue 46): fixed-length blocks stacked by
`default_data_collator`, `DataCollatorWithPadding`, TRL's packed rows for each packing strategy and padding-free
rows. Each run has a target (the tuner on), runs out of memory mid-window once training has begun, and is exact
against the independent float64 reference (each step one pass over its samples, or each packed sequence alone)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from transformers import DataCollatorWithPadding, TrainerCallback, default_data_collator
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments, tiny

from .exactness import (
    VOCAB,
    StepRecorder,
    cls_examples,
    lm_examples,
    max_relative_error,
    max_step_error,
    recording,
    reference_run,
    tiny_llama,
    tiny_llama_cls,
)
from .test_padding_free import reference_grads


class OOMInTraining(TrainerCallback):
    """Raises torch.OutOfMemoryError at the ``call``-th training forward of ``module`` after training begins (the
    probe's forwards come before and are not counted)."""

    def __init__(self, module, call: int):
        self.call, self.count, self.armed = call, 0, False
        module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self.armed and module.training:
            self.count += 1
            if self.count == self.call:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")

    def on_train_begin(self, args, state, control, **kwargs):
        self.armed = True


COMMON = dict(target_batch_size=8, probe_max_micro_batch=4, num_train_epochs=1, learning_rate=1e-2,
              max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
              disable_tqdm=True)


def fixed_blocks(n: int, width: int = 32, seed: int = 0) -> list[dict]:
    """What run_clm's group_texts makes: blocks of one length, labels = input_ids, a mask of ones."""
    g = random.Random(seed)
    ids = [[g.randint(1, VOCAB - 1) for _ in range(width)] for _ in range(n)]
    return [{"input_ids": x, "attention_mask": [1] * width, "labels": list(x)} for x in ids]


def train(tmp_path, model, data, collator, caplog, oom_module, **kw):
    args = AccumTrainingArguments(output_dir=str(tmp_path), remove_unused_columns=False, **COMMON, **kw)
    recorder = StepRecorder()
    oom = OOMInTraining(oom_module, call=4)  # micro 4 x accumulation 2: the second forward of step 2
    trainer = recording(AccumTrainer)(model=model, args=args, train_dataset=data, data_collator=collator,
                                      callbacks=[recorder, oom])
    trainer.remove_callback(PrinterCallback)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert trainer.probe_result is not None and trainer.probe_result.trials  # the tuner probed
    assert oom.count >= 4 and "out of memory at step 1" in caplog.text and trainer.plan.micro_batch_size < 4
    assert trainer.plan.target_batch_size == 8
    return trainer, recorder


def test_default_data_collator_on_fixed_blocks(tmp_path, caplog):
    model = tiny_llama()
    trainer, recorder = train(tmp_path, model, fixed_blocks(24), default_data_collator, caplog, model.model.layers[1])
    assert all(b["input_ids"].shape[1] == 32 for w in trainer.windows for b in w)
    ref = reference_run(tiny_llama(), recorder, trainer.windows, "causal")  # the recorded weights, step by step
    assert len(ref.grads) == 3 and max_step_error(recorder, ref) <= 1e-6


def test_data_collator_with_padding(tmp_path, caplog):
    model = tiny_llama_cls()
    collator = DataCollatorWithPadding(tiny.build_tokenizer())  # its pad id is the models' (0)
    trainer, recorder = train(tmp_path, model, cls_examples(24, seed=3), collator, caplog, model.model.layers[1],
                              loss_normalization="samples")
    assert any(not bool(b["attention_mask"].all()) for w in trainer.windows for b in w)  # really padded
    ref = reference_run(tiny_llama_cls(), recorder, trainer.windows, "cls")
    assert len(ref.grads) == 3 and max_step_error(recorder, ref) <= 1e-6


@pytest.mark.parametrize("case", ["bfd", "bfd_split", "wrapped", "padding_free"])
def test_trl_packed_and_padding_free_rows(tmp_path, caplog, case):
    datasets = pytest.importorskip("datasets")
    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer

    rows = [{"input_ids": e["input_ids"]} for e in lm_examples(24, seed=5)]  # 4 to 40 tokens
    kw = (dict(padding_free=True, max_length=None) if case == "padding_free"
          else dict(packing=True, packing_strategy=case, max_length=24))
    model = tiny_llama()
    args = AccumSFTConfig(output_dir=str(tmp_path), bf16=False, **COMMON, **kw)
    recorder = StepRecorder()
    oom = OOMInTraining(model.model.layers[1], call=4)
    trainer = recording(AccumSFTTrainer)(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                         processing_class=tiny.build_tokenizer(), callbacks=[recorder, oom])
    trainer.remove_callback(PrinterCallback)
    if case.startswith("bfd"):
        assert "seq_lengths" in trainer.train_dataset.column_names  # packed rows, as the crash had
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert trainer.probe_result is not None and trainer.probe_result.trials
    assert oom.count >= 4 and "out of memory at step 1" in caplog.text
    windows = trainer.windows
    if case == "wrapped":  # padded rows of max_length tokens (the last shorter), each row one sequence
        assert max(b["input_ids"].shape[1] for w in windows for b in w) == 24
        ref = reference_run(tiny_llama(), recorder, windows, "causal")
        assert max_step_error(recorder, ref) <= 1e-6
    else:  # one row of several sequences per forward: each sequence alone in the reference
        assert all(b["input_ids"].shape[0] == 1 and "position_ids" in b for w in windows for b in w)
        assert max_relative_error(recorder.grads, reference_grads(recorder, windows, "tokens")) <= 1e-6
