"""`AccumSeq2SeqTrainer` / `AccumSeq2SeqTrainingArguments`: transformers' Seq2SeqTrainer and its arguments with ours.

Exact over the target tokens of encoder-decoder windows (tiny BART and T5, float64) against the independent
reference of tests/exactness.py (one forward over the window's samples, cross-entropy by hand from the logits); the
4x case: plain `Seq2SeqTrainer` steps BART (whose forward ignores `num_items_in_batch`) with the sum of its
micro-batch means, each recomputed here alone; and `predict_with_generate` evaluation, its eval batch measured
generating to full length."""

import copy
import logging

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments, AccumTrainingArguments, AccumulationMixin
from tests.exactness import (
    StepRecorder,
    logged_losses,
    max_step_error,
    pad_collate,
    recording,
    reference_run,
    reference_step,
    seq2seq_examples,
    tiny_bart,
    tiny_t5,
)


def _args(cls, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=4, max_steps=2,
                optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
                report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                remove_unused_columns=False)
    return cls(**{**base, **kw})


def _train(trainer_cls, args, model, data):
    recorder = StepRecorder()
    trainer = recording(trainer_cls)(model=model, args=args, train_dataset=data, data_collator=pad_collate,
                                     callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer, recorder


def test_the_names_are_public_and_join_both_classes():
    import hf_accum

    assert issubclass(AccumSeq2SeqTrainer, Seq2SeqTrainer) and issubclass(AccumSeq2SeqTrainer, AccumulationMixin)
    assert issubclass(AccumSeq2SeqTrainingArguments, Seq2SeqTrainingArguments)
    assert issubclass(AccumSeq2SeqTrainingArguments, AccumTrainingArguments)
    assert {"AccumSeq2SeqTrainer", "AccumSeq2SeqTrainingArguments"} <= set(hf_accum.__all__)


@pytest.mark.parametrize("build", [tiny_bart, tiny_t5], ids=["bart", "t5"])
@pytest.mark.parametrize("target", [16, None], ids=["target", "no_target"])
def test_exact_over_the_windows_target_tokens(tmp_path, build, target):
    model = build()
    initial = copy.deepcopy(model)
    args = _args(AccumSeq2SeqTrainingArguments, tmp_path, target_batch_size=target, auto_tune=False)
    trainer, recorder = _train(AccumSeq2SeqTrainer, args, model, seq2seq_examples(32, seed=2))
    ref = reference_run(initial, recorder, trainer.windows, "seq2seq")
    assert [len(w) for w in trainer.windows] == [4, 4]
    assert max_step_error(recorder, ref) < 1e-9
    assert logged_losses(trainer) == pytest.approx(ref.losses, rel=1e-6)  # logged in float32


def test_plain_seq2seq_trainer_steps_bart_with_the_sum_of_micro_batch_means(tmp_path):
    """The 4x case (docs/exactness.md): plain logs and steps the sum of the 4 micro-batch means, ours the mean."""
    data = seq2seq_examples(32, seed=2)
    plain, plain_rec = _train(Seq2SeqTrainer, _args(Seq2SeqTrainingArguments, tmp_path / "p", max_steps=1),
                              tiny_bart(), data)
    ours, _ = _train(AccumSeq2SeqTrainer, _args(AccumSeq2SeqTrainingArguments, tmp_path / "o", max_steps=1),
                     tiny_bart(), data)
    window = plain.windows[0]
    assert [b["input_ids"].tolist() for b in window] == [b["input_ids"].tolist() for b in ours.windows[0]]
    reference = tiny_bart()
    sum_of_means = sum(reference_step(reference, [b], "seq2seq")[1] for b in window)
    exact_grads, exact = reference_step(reference, window, "seq2seq")
    assert logged_losses(plain)[0] == pytest.approx(sum_of_means, rel=1e-6)
    assert logged_losses(ours)[0] == pytest.approx(exact, rel=1e-6)
    assert 3.5 < sum_of_means / exact < 4.5
    grad = plain_rec.grads[0]["model.shared.weight"]
    assert float(grad.norm() / exact_grads["model.shared.weight"].norm()) > 3  # the step, too, is ~4x


def _generation_case(tmp_path, caplog, target):
    model = tiny_bart(torch.float32)
    data = seq2seq_examples(24, seed=5)
    args = _args(AccumSeq2SeqTrainingArguments, tmp_path, target_batch_size=target, predict_with_generate=True,
                 generation_max_length=12, per_device_eval_batch_size=2)
    lengths = []
    generate = model.generate

    def counting_generate(*a, **kw):
        out = generate(*a, **kw)
        lengths.append(int(out.shape[-1]))
        return out

    model.generate = counting_generate
    trainer = AccumSeq2SeqTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:10],
                                  data_collator=pad_collate, compute_metrics=lambda p: {"n": float(len(p[0]))})
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
        lengths.clear()
        metrics = trainer.evaluate()
        measured = trainer.args.per_device_eval_batch_size
        predicted = trainer.predict(data[:6])
    return trainer, metrics, predicted, lengths, measured


def test_predict_with_generate_with_a_target_measures_generation_at_full_length(tmp_path, caplog):
    trainer, metrics, predicted, lengths, measured = _generation_case(tmp_path, caplog, target=16)
    assert "generating to full length, its tokens kept" in caplog.text
    assert measured > 2  # planned (tiny model: the whole eval set fits)
    # the measuring generations ran to generation_max_length; the evaluation's own generations are its own
    assert lengths and lengths[0] == 12
    assert metrics["eval_n"] == 10 and "eval_loss" in metrics
    assert predicted.predictions.shape[0] == 6
    said = [r for r in caplog.records if "eval_loss is transformers' value" in r.getMessage()]
    assert len(said) == 1 and "compute_loss" in said[0].getMessage()  # the generating step's loss: said once


def test_predict_with_generate_without_a_target_runs_as_seq2seq_trainer(tmp_path, caplog):
    trainer, metrics, predicted, lengths, measured = _generation_case(tmp_path, caplog, target=None)
    assert measured == 2  # no target: no auto_tune, the eval batch as given
    assert metrics["eval_n"] == 10 and predicted.predictions.shape[0] == 6


@pytest.mark.parametrize("build", [tiny_bart, tiny_t5], ids=["bart", "t5"])
def test_generated_predictions_and_metrics_are_seq2seq_trainers(tmp_path, build):
    model = build(torch.float32)
    data = seq2seq_examples(10, seed=5)
    out = {}
    for name, trainer_cls, args_cls in [("plain", Seq2SeqTrainer, Seq2SeqTrainingArguments),
                                        ("ours", AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments)]:
        args = _args(args_cls, tmp_path / name, predict_with_generate=True, generation_max_length=9,
                     generation_num_beams=2, per_device_eval_batch_size=3)
        trainer = trainer_cls(model=copy.deepcopy(model), args=args, eval_dataset=data, data_collator=pad_collate,
                              compute_metrics=lambda p: {"tokens": float((p[0] != 0).sum())})
        predicted = trainer.predict(data)
        out[name] = predicted.predictions, predicted.label_ids, trainer.evaluate()["eval_tokens"]
    assert (out["plain"][0] == out["ours"][0]).all() and (out["plain"][1] == out["ours"][1]).all()
    assert out["plain"][2] == out["ours"][2]


# transformers' tests/trainer/test_trainer_seq2seq.py needs the hub (t5-small, gsm8k); its two checks that do not
# depend on a pretrained model, offline, with our classes:
@pytest.mark.parametrize("target", [16, None], ids=["target", "no_target"])
def test_num_return_sequences_are_all_gathered(tmp_path, target):
    """transformers' test_return_sequences: evaluate(generation_config=...) with num_return_sequences k gives
    k x the eval set's predictions (Seq2SeqTrainer gathers with accelerator.gather); with a target, the eval batch is
    measured generating k sequences per example."""
    from transformers import GenerationConfig

    data = seq2seq_examples(7, seed=3)
    args = _args(AccumSeq2SeqTrainingArguments, tmp_path, predict_with_generate=True, target_batch_size=target,
                 per_device_eval_batch_size=2)
    trainer = AccumSeq2SeqTrainer(model=tiny_bart(torch.float32), args=args, data_collator=pad_collate,
                                  compute_metrics=lambda p: {"samples": p[0].shape[0]}, eval_dataset=data)
    for k in (3, 1):
        config = GenerationConfig(max_new_tokens=5, min_new_tokens=1, num_beams=3, num_return_sequences=k,
                                  decoder_start_token_id=2, eos_token_id=1, pad_token_id=0)
        assert trainer.evaluate(generation_config=config)["eval_samples"] == 7 * k


def test_a_bad_generation_config_fails_early(tmp_path):
    """transformers' test_bad_generation_config_fail_early, with our arguments and trainer: Seq2SeqTrainer's error."""
    from transformers import GenerationConfig

    bad = GenerationConfig(do_sample=False, top_p=0.9)
    said = []
    for trainer_cls, args_cls in [(Seq2SeqTrainer, Seq2SeqTrainingArguments),
                                  (AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments)]:
        args = _args(args_cls, tmp_path, predict_with_generate=True, generation_config=bad)
        with pytest.raises(ValueError, match="GenerationConfig is invalid|generation config instance is invalid") as e:
            trainer_cls(model=tiny_bart(torch.float32), args=args, data_collator=pad_collate)
        said.append(str(e.value))
    assert said[0] == said[1]


@pytest.mark.slow  # a pytest subprocess: mostly imports
def test_the_peer_harness_swaps_seq2seq_trainer_and_its_arguments(tmp_path):
    """scripts/swap/swap_conftest.py (trainer_swap_suite.py's plugin) hands transformers' test_trainer_seq2seq.py our
    Seq2Seq classes: in swapped-target mode `Seq2SeqTrainer` is ours, and its arguments ours with the implied
    target (swapped mode swaps the trainer alone, as for `Trainer`)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "test_names.py").write_text(
        "from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments\n"
        "def test_names():\n"
        "    args = Seq2SeqTrainingArguments('out', per_device_train_batch_size=2, use_cpu=True, report_to='none')\n"
        "    print('CLASSES', Seq2SeqTrainer.__name__, type(args).__name__, getattr(args, 'target_batch_size', None))\n")
    env = {**os.environ, "HF_ACCUM_SWAP": "1", "HF_ACCUM_SWAP_TARGET": "1",
           "PYTHONPATH": os.pathsep.join([str(root / "scripts" / "swap"), str(root)])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "test_names.py", "-p", "swap_conftest", "-p",
                          "no:cacheprovider"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    line = next(x for x in out.stdout.splitlines() if "CLASSES" in x)
    assert line.endswith("CLASSES AccumSeq2SeqTrainer TargetedSeq2SeqTrainingArguments 2"), out.stdout[-2000:]
