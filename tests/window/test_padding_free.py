"""Padding-free batches (`DataCollatorWithFlattening`: one [1, T] row holding several sequences): exact training,
OOM recovery that re-runs fewer *sequences* per forward, "samples" counting sequences, and `check_accumulation`.
The reference forwards each sequence alone and computes the cross-entropy by hand in float64."""

import logging

import pytest
import torch.nn.functional as F
from transformers import DataCollatorWithFlattening
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from tests.exactness import StepRecorder, lm_examples, load_weights, max_relative_error, recording, tiny_llama
from tests.trainer.test_oom_recovery import OOMAt


def sequences_of(batch):
    """The sequences of a flattened batch, split where position_ids restart at 0 (the collator's format)."""
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    return [(batch["input_ids"][:, a:b], batch["labels"][:, a:b]) for a, b in zip(starts[:-1], starts[1:])]


def reference_grads(recorder, windows, mode):
    model = tiny_llama()
    out = []
    for weights, window in zip(recorder.weights, windows):
        load_weights(model, weights)
        model.zero_grad(set_to_none=True)
        total, count, seqs = 0.0, 0, 0
        for b in window:
            for ids, labels in sequences_of(b):  # each sequence alone
                logits = model(input_ids=ids).logits[:, :-1].double()
                target = labels[:, 1:]
                total = total + F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                ignore_index=-100, reduction="sum")
                count += int(target.ne(-100).sum())
                seqs += 1
        (total / (count if mode == "tokens" else seqs)).backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def max_error(recorder, ref):
    return max_relative_error(recorder.grads, ref)


def run(tmp_path, micro=4, accum=2, mode="tokens", oom_calls=(), n=24, **kw):
    model = tiny_llama()
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        target_batch_size=micro * accum, auto_tune=False, num_train_epochs=1, learning_rate=1e-2,
        max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, remove_unused_columns=False, loss_normalization=mode, **kw,
    )
    recorder = StepRecorder()
    trainer = recording(AccumTrainer)(model=model, args=args, train_dataset=lm_examples(n, seed=5),
                                      data_collator=DataCollatorWithFlattening(), callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    per_forward = []
    model.register_forward_pre_hook(
        lambda m, a, kw: per_forward.append(int((kw["position_ids"][0] == 0).sum())) if m.training else None,
        with_kwargs=True)
    # raised inside a decoder layer's forward, with the earlier layers' activations alive
    injector = OOMAt(model.model.layers[1], oom_calls) if oom_calls else None
    trainer.train()
    return trainer, recorder, per_forward, injector


@pytest.mark.parametrize("mode", ["tokens", "samples"])
def test_flattened_batches_are_exact(tmp_path, mode):
    trainer, recorder, per_forward, _ = run(tmp_path, mode=mode)
    assert all(b["input_ids"].shape[0] == 1 for w in trainer.windows for b in w)  # really padding-free
    assert set(per_forward) == {4}  # 4 sequences per forward, one row
    assert max_error(recorder, reference_grads(recorder, trainer.windows, mode)) <= 1e-6


def test_samples_mode_counts_sequences_not_rows(tmp_path):
    trainer, *_ = run(tmp_path, mode="samples", n=8, micro=4, accum=2)
    batch = trainer.windows[0][0]
    assert trainer._engine.cutter.unit == "sequences"
    assert int(trainer._engine.cutter.count(batch, "samples")) == 4


def test_oom_mid_window_reruns_fewer_sequences_per_forward(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        hit, recorder, per_forward, injector = run(tmp_path / "hit", oom_calls=(3,))
    assert "out of memory at step 1" in caplog.text and hit.plan.micro_batch_size == 2
    # window 1: two forwards of 4 sequences; window 2's first forward runs out; then 2 sequences per forward
    assert per_forward[:3] == [4, 4, 4] and set(per_forward[3:]) == {2}
    assert max_error(recorder, reference_grads(recorder, hit.windows, "tokens")) <= 1e-6
    clean, *_ = run(tmp_path / "clean", micro=2, accum=4)
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(hit.model.parameters(), clean.model.parameters()))
    den = sum(float(b.pow(2).sum()) for b in clean.model.parameters())
    assert (num / den) ** 0.5 <= 1e-6


def test_check_accumulation_ok_on_flattened_batches(tmp_path):
    model = tiny_llama()
    args = AccumTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True,
                                  report_to=[], remove_unused_columns=False)
    trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(8, seed=5),
                           data_collator=DataCollatorWithFlattening())
    result = trainer.check_accumulation(num_micro_batches=2)
    assert result.skipped_reason is None and result.passed
    assert result.micro_batch_sizes == [2, 2] and result.relative_error < 1e-6
