"""The probe's batch is one the user's collator takes, whatever the data (issue 46): fixed-length blocks stacked by
`default_data_collator`, `DataCollatorWithPadding`, TRL's packed rows for each packing strategy and padding-free
rows. Each run has a target (the tuner on), runs out of memory mid-window once training has begun, and is exact
against the independent float64 reference (each step one pass over its samples, or each packed sequence alone)."""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch
from transformers import DataCollatorWithPadding, TrainerCallback, default_data_collator
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments, tiny
from tests.exactness import (
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
from tests.trainer.test_custom_loader import MultiLoader  # transformers' tests' loader of loaders: no .dataset
from tests.window.test_padding_free import reference_grads


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


# probe_from_estimate=False: the estimate steps its own random batches on paper; what is tested here is the batches
# the real probe steps (the seed would only say where its search starts, at ~3 s of fake steps per tune)
COMMON = dict(target_batch_size=8, probe_max_micro_batch=4, num_train_epochs=1, learning_rate=1e-2,
              max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
              disable_tqdm=True, probe_from_estimate=False)


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


# --- data the scan could not read before: 0-d tensors, a loader without .dataset, iterable TRL data ---------------
class Regression(torch.nn.Module):
    """transformers' tests' RegressionModel: y = a * x + b, MSE loss, one number per example."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.tensor(0.5)), torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        return (torch.nn.functional.mse_loss(y, labels), y)


def test_examples_of_0_d_tensors_are_scanned(tmp_path):
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, generator=g)
    data = datasets.Dataset.from_dict({"input_x": x.tolist(), "labels": (2 * x + 3).tolist()}).with_format("torch")
    assert data[0]["input_x"].dim() == 0  # what transformers' test_trainer_with_datasets hands the trainer
    args = AccumTrainingArguments(output_dir=str(tmp_path), **{**COMMON, "learning_rate": 0.1},
                                  loss_normalization="samples")
    trainer = AccumTrainer(model=Regression(), args=args, train_dataset=data)
    trainer.train()
    assert trainer.probe_result is not None and trainer.state.global_step == 4


class TwoLoaders(AccumTrainer):
    def get_train_dataloader(self):
        return MultiLoader([super().get_train_dataloader(), super().get_train_dataloader()])


def test_a_loader_without_dataset_is_scanned_for_its_widest_batch(tmp_path, caplog):
    from tests.exactness import pad_collate

    model = tiny_llama()
    args = AccumTrainingArguments(output_dir=str(tmp_path), remove_unused_columns=False, **COMMON)
    recorder = StepRecorder()
    trainer = recording(TwoLoaders)(model=model, args=args, train_dataset=lm_examples(16, seed=1),
                                    data_collator=pad_collate, callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        trainer.train()
    assert "returned a MultiLoader without .dataset; the probe measures the widest batch" in caplog.text
    assert trainer.probe_result is not None and trainer.plan.target_batch_size == 8
    widest = max(b["input_ids"].shape[1] for w in trainer.windows for b in w)
    assert trainer.planner.key["seq_len"] == widest  # the widest batch the loader yields is the probe's length
    ref = reference_run(tiny_llama(), recorder, trainer.windows, "causal")
    assert len(ref.grads) == 4 and max_step_error(recorder, ref) <= 1e-6


def test_a_collator_that_fails_on_the_probe_batch_is_one_line(tmp_path):
    def picky(rows):  # refuses one example twice in a batch: the probe's batch (copies of the longest) is such
        if len(rows) > 1 and rows[0] is rows[1]:
            raise RuntimeError("picky takes each example once\nsecond line of detail")
        return default_data_collator(rows)

    args = AccumTrainingArguments(output_dir=str(tmp_path), remove_unused_columns=False, **COMMON)
    trainer = AccumTrainer(model=tiny_llama(), args=args, train_dataset=fixed_blocks(8), data_collator=picky)
    with pytest.raises(ValueError) as err:
        trainer.train()
    message = str(err.value)
    assert "\n" not in message and err.value.__cause__ is None and err.value.__suppress_context__
    assert re.match(r"The data collator test_a_collator_that_fails_on_the_probe_batch_is_one_line\.<locals>\.picky "
                    r"failed on the probe's batch \(\d+ copies of the longest training example\): RuntimeError: "
                    r"picky takes each example once\. Fix the collator", message)
    assert "probe_seq_len" in message


def sft_iterable(tmp_path, **kw):
    datasets = pytest.importorskip("datasets")
    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer

    rows = [{"input_ids": e["input_ids"]} for e in lm_examples(24, seed=5)]
    args = AccumSFTConfig(output_dir=str(tmp_path), bf16=False, **{**COMMON, "max_steps": 2}, **kw)
    return AccumSFTTrainer(model=tiny_llama(), args=args, processing_class=tiny.build_tokenizer(),
                           train_dataset=datasets.Dataset.from_list(rows).to_iterable_dataset())


@pytest.mark.parametrize("packing", [False, True])
def test_sft_iterable_dataset_is_planned_at_max_length(tmp_path, caplog, packing):
    trainer = sft_iterable(tmp_path, max_length=24, packing=packing)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.probe_result is not None
    assert ("the training set is an iterable dataset, so its longest example is unknown; the plan is for examples "
            "of 24 tokens, the longest AccumSFTTrainer with max_length=24 (SFTTrainer truncates to it) lets "
            "through.") in caplog.text
    assert trainer.planner.key["seq_len"] == 24


def test_sft_iterable_dataset_without_a_bound_is_refused(tmp_path):
    trainer = sft_iterable(tmp_path, max_length=None)
    with pytest.raises(ValueError, match="iterable dataset, so its longest example is unknown; set probe_seq_len") as e:
        trainer.train()
    # one message, not chained to the TypeError of len() (issue 59, item 11: a 41-line traceback ended in it)
    assert e.value.__context__ is None and e.value.__cause__ is None


def test_dpo_iterable_dataset_is_planned_at_max_length(tmp_path, caplog):
    pytest.importorskip("trl")
    from hf_accum.trl import AccumDPOConfig, AccumDPOTrainer
    from tests.integrations.test_dpo import preference_data

    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    args = AccumDPOConfig(output_dir=str(tmp_path), bf16=False, max_length=48, **{**COMMON, "max_steps": 2})
    ref = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    trainer = AccumDPOTrainer(model=model, ref_model=ref, args=args, processing_class=tok,
                              train_dataset=preference_data(16).to_iterable_dataset())
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.planner.key["seq_len"] == 48
    assert "AccumDPOTrainer with max_length=48 (DPOTrainer truncates to it)" in caplog.text


class RegressionRows(torch.utils.data.IterableDataset):
    """transformers' tests' SampleIterableDataset: rows of one number each, no length."""

    def __init__(self, n=32):
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        self.rows = [{"input_x": x[i], "labels": 2 * x[i] + 3} for i in range(n)]

    def __iter__(self):
        yield from self.rows


def test_an_iterable_dataset_of_examples_without_sequences_is_planned_from_its_first(tmp_path, caplog):
    """No sequence, no bound needed: every example is one size. The steps are those of transformers' Trainer on
    the full batch of 8 (micro 4 x accumulation 2 here)."""
    from transformers import Trainer, TrainingArguments

    kw = {**COMMON, "max_steps": 4, "learning_rate": 0.1}
    args = AccumTrainingArguments(output_dir=str(tmp_path), loss_normalization="samples", **kw)
    trainer = AccumTrainer(model=Regression(), args=args, train_dataset=RegressionRows())
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    assert trainer.state.global_step == 4 and trainer.probe_result is not None
    assert trainer.plan.micro_batch_size == 4 and trainer.plan.gradient_accumulation_steps == 2
    assert caplog.text.count("an iterable dataset of examples with no sequence (each one the same size); the plan is "
                             "measured on its first example.") == 1
    del kw["target_batch_size"], kw["probe_max_micro_batch"], kw["probe_from_estimate"]
    plain = Trainer(model=Regression(), args=TrainingArguments(output_dir=str(tmp_path / "plain"),
                                                               per_device_train_batch_size=8, **kw),
                    train_dataset=RegressionRows())
    plain.train()
    for ours, theirs in zip(trainer.model.parameters(), plain.model.parameters()):
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)


def test_an_iterable_dataset_of_sequences_for_a_model_that_is_no_causal_lm_is_refused_with_a_fix_that_works(tmp_path):
    """probe_seq_len is for causal LMs only: the refusal names what works for this model, and that fix trains."""
    datasets = pytest.importorskip("datasets")
    from tests.exactness import pad_collate

    def trainer_for(**kw):
        data = datasets.Dataset.from_list(cls_examples(32, seed=2)).to_iterable_dataset()
        args = AccumTrainingArguments(output_dir=str(tmp_path), remove_unused_columns=False,
                                      **{**COMMON, "max_steps": 2, **kw})
        return AccumTrainer(model=tiny_llama_cls(), args=args, train_dataset=data, data_collator=pad_collate)

    with pytest.raises(ValueError) as err:
        trainer_for().train()
    assert str(err.value) == (
        "The training set is an iterable dataset, so its longest example is unknown; give a sized train_dataset (a "
        "datasets.Dataset, or any dataset with __len__: the probe reads its longest example), or set auto_tune=False "
        "with per_device_train_batch_size x gradient_accumulation_steps x world size = target_batch_size.")
    trainer = trainer_for(auto_tune=False, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2


def test_tensor_rows_of_one_length_with_the_trainers_default_collator(tmp_path):
    """transformers' tests' RepeatDataset (one 128-token tensor per row, no collator given): the probe once made
    the second copy 127 tokens and `default_data_collator` could not stack them."""
    x = torch.randint(1, VOCAB, (128,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for _ in range(16)]
    args = AccumTrainingArguments(output_dir=str(tmp_path), **{**COMMON, "max_steps": 1})
    trainer = AccumTrainer(model=tiny_llama(), args=args, train_dataset=data)
    assert trainer.data_collator is default_data_collator
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.planner.key["seq_len"] == 128
