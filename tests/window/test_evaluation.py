"""eval_loss is the exact mean over the whole evaluation set in training's unit, whatever the eval batch, the
number of ranks or an out-of-memory re-run (hf_accum/window/evaluation.py). The reference is independent: each example
forwarded alone, float64 cross-entropy by hand; transformers' own value is shown to differ on the same data."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2, tiny_llama
from tests.trainer.test_oom_recovery import OOMAt

TORCHRUN = pytest.mark.xdist_group("torchrun")  # the multi-rank tests share one pytest-xdist worker: two
# two-rank runs at once on 2 cores were seen to hang. The file's one-process tests go to either worker.

N_EVAL = 21  # 21 = 2 x 8 + 5 = 7 x 3: short last batches, and on two ranks rows accelerate repeats


def eval_data(n: int = N_EVAL) -> list[dict]:
    return lm_examples(n, seed=5)


def eval_model():
    return tiny_gpt2()  # float64 end to end (Llama's RMSNorm runs in float32)


def reference(model, data, mode="tokens") -> float:
    """Every example forwarded alone; cross-entropy of its shifted labels by hand, in float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        for e in data:
            logits = model(input_ids=torch.tensor([e["input_ids"]])).logits[0, :-1].double()
            labels = torch.tensor(e["labels"][1:])
            keep = labels.ne(-100)
            logp = torch.log_softmax(logits[keep], -1)
            total += float(-logp.gather(1, labels[keep][:, None]).sum())
            count += int(keep.sum()) if mode == "tokens" else 1
    return total / count


def trainer_for(model, b, *, plain=False, out="out", **kw):
    cls, args_cls = (Trainer, TrainingArguments) if plain else (AccumTrainer, AccumTrainingArguments)
    kw.setdefault("compute_loss_func", sum_over_items_loss)  # a float64 loss (transformers' casts to float32)
    trainer_kw = {k: kw.pop(k) for k in ("compute_loss_func", "compute_metrics", "train_dataset") if k in kw}
    args = args_cls(output_dir=out, per_device_eval_batch_size=b, report_to=[], use_cpu=True, disable_tqdm=True,
                    remove_unused_columns=False, **kw)
    trainer = cls(model=model, args=args, eval_dataset=eval_data(), data_collator=pad_collate, **trainer_kw)
    trainer.remove_callback(PrinterCallback)
    return trainer


@pytest.mark.parametrize("b", [1, 3, 8])
def test_eval_loss_is_the_token_mean_whatever_the_eval_batch(tmp_path, b):
    model = eval_model()
    want = reference(model, eval_data())
    ours = trainer_for(model, b, out=str(tmp_path)).evaluate()["eval_loss"]
    theirs = trainer_for(model, b, plain=True, out=str(tmp_path)).evaluate()["eval_loss"]
    assert abs(ours - want) <= 1e-12
    assert abs(theirs - want) > 1e-4  # transformers weights each sample by its batch's mean: the bug fixed here


def test_the_models_own_loss_path_too(tmp_path):
    """Llama's own loss (num_items_in_batch passed to the model; it computes in float32): batch-independent to
    float32 rounding, where transformers' value moves by 1e-3."""
    model = tiny_llama()
    want = reference(model, eval_data())
    ours = [trainer_for(model, b, out=str(tmp_path), compute_loss_func=None).evaluate()["eval_loss"]
            for b in (1, 3, 8)]
    theirs = [trainer_for(model, b, plain=True, out=str(tmp_path), compute_loss_func=None).evaluate()["eval_loss"]
              for b in (1, 3, 8)]
    assert max(abs(x - want) for x in ours) <= 1e-6 * want
    assert max(theirs) - min(theirs) > 1e-4


def test_samples_mode_is_the_mean_over_samples(tmp_path):
    model = eval_model()
    want = reference(model, eval_data(), mode="samples")
    for b in (1, 3, 8):
        got = trainer_for(model, b, out=str(tmp_path), loss_normalization="samples").evaluate()["eval_loss"]
        assert abs(got - want) <= 1e-12


def test_predict_and_evaluation_during_training(tmp_path):
    model = eval_model()
    trainer = trainer_for(model, 3, out=str(tmp_path), train_dataset=lm_examples(8, seed=1),
                          per_device_train_batch_size=4, gradient_accumulation_steps=2, target_batch_size=8,
                          auto_tune=False, max_steps=1, eval_strategy="steps", eval_steps=1, save_strategy="no",
                          learning_rate=1e-2)
    trainer.train()
    logged = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    want = reference(model, eval_data())  # the weights after the one step, which the evaluation saw
    assert len(logged) == 1 and abs(logged[0] - want) <= 1e-12
    assert abs(trainer.predict(eval_data()).metrics["test_loss"] - want) <= 1e-12


def test_an_oom_mid_evaluation_re_runs_that_batch_in_halves_with_a_clean_runs_metrics(tmp_path, caplog):
    model = eval_model()
    clean = trainer_for(model, 8, out=str(tmp_path)).predict(eval_data())
    trainer = trainer_for(model, 8, out=str(tmp_path))
    injector = OOMAt(model, [2], training=False)  # the second batch's forward fails once
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        hit = trainer.predict(eval_data())
    injector.handle.remove()
    # batches of 8, 8, 5: 1 + 1 failed + 2 halves of 4 + the last batch cut to the 4 that fitted (4 + 1)
    assert injector.count == 6 and "out of memory in evaluation on a batch of 8" in caplog.text
    assert abs(hit.metrics["test_loss"] - reference(model, eval_data())) <= 1e-12
    assert abs(hit.metrics["test_loss"] - clean.metrics["test_loss"]) <= 1e-12
    assert hit.predictions.shape == clean.predictions.shape
    torch.testing.assert_close(torch.as_tensor(hit.predictions), torch.as_tensor(clean.predictions), rtol=0,
                               atol=1e-12)
    assert (hit.label_ids == clean.label_ids).all()
    assert trainer.args.per_device_eval_batch_size == 8  # the eval batch the user set is never written to


def test_an_oom_at_one_row_is_raised(tmp_path):
    model = eval_model()
    trainer = trainer_for(model, 2, out=str(tmp_path))
    OOMAt(model, range(1, 100), training=False)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.evaluate()


class PerSampleLoss(AccumTrainer):
    """A compute_loss override whose loss is a vector: eval_loss cannot be counted, so it stays transformers'."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss.repeat(2)
        return (loss, outputs) if return_outputs else loss


def test_what_cannot_be_counted_keeps_transformers_value_and_says_so_once(tmp_path, caplog):
    model = eval_model()
    args = AccumTrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=3, report_to=[],
                                  use_cpu=True, remove_unused_columns=False)
    trainer = PerSampleLoss(model=model, args=args, eval_dataset=eval_data(), data_collator=pad_collate,
                            compute_loss_func=sum_over_items_loss)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        first, second = trainer.evaluate()["eval_loss"], trainer.evaluate()["eval_loss"]
    theirs = trainer_for(model, 3, plain=True, out=str(tmp_path)).evaluate()["eval_loss"]
    assert first == second == pytest.approx(theirs, rel=1e-12, abs=0)
    assert caplog.text.count("eval_loss is transformers' value") == 1 and "shape (2,)" in caplog.text


def test_loss_normalization_model_keeps_transformers_value(tmp_path):
    model = eval_model()
    ours = trainer_for(model, 3, out=str(tmp_path), loss_normalization="model").evaluate()["eval_loss"]
    theirs = trainer_for(model, 3, plain=True, out=str(tmp_path)).evaluate()["eval_loss"]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0)


def test_trl_sft_trainer(tmp_path):
    """TRL's prediction_step passes no count to compute_loss; hf_accum gives it one. TRL computes its loss in
    float32 here, so the bound is float32 rounding; TRL's own value moves by 1e-3 with the eval batch."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_accum import tiny
    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer

    tok = tiny.build_tokenizer()
    rows = tiny.generate_instruction_data(21, seed=3)
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in rows])
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    got = {}
    for name, cls, args_cls in (("ours", AccumSFTTrainer, AccumSFTConfig), ("trl", SFTTrainer, SFTConfig)):
        for b in (1, 3, 8):
            args = args_cls(output_dir=str(tmp_path), per_device_eval_batch_size=b, report_to=[], use_cpu=True,
                            bf16=False, max_length=64, disable_tqdm=True)
            trainer = cls(model=model, args=args, train_dataset=data, eval_dataset=data, processing_class=tok)
            got[name, b] = trainer.evaluate()["eval_loss"]
    total, count = 0.0, 0
    with torch.no_grad():
        for row in trainer.eval_dataset:  # TRL's own tokenization and labels; each row forwarded alone
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1].double()
            labels = torch.tensor(row["labels"][1:])
            keep = labels.ne(-100)
            total += float(F.cross_entropy(logits[keep], labels[keep], reduction="sum"))
            count += int(keep.sum())
    want = total / count
    assert max(abs(got["ours", b] - want) for b in (1, 3, 8)) <= 1e-7 * want
    assert max(got["trl", b] for b in (1, 3, 8)) - min(got["trl", b] for b in (1, 3, 8)) > 1e-3


def test_trl_dpo_trainer_counts_pairs(tmp_path, caplog):
    """DPO ("samples": one pair) has no labels to count; its eval_loss is the mean over every pair, which at eval
    batch 1 is also DPOTrainer's value (its log-probabilities pass through float32)."""
    import copy

    from trl import DPOConfig, DPOTrainer

    from hf_accum import tiny
    from hf_accum.trl import AccumDPOConfig, AccumDPOTrainer
    from tests.integrations.test_dpo import preference_data

    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # a reference unlike the policy: losses differ from ln 2 per pair
    data = preference_data(21)

    def evaluate(cls, args_cls, b):
        args = args_cls(output_dir=str(tmp_path), per_device_eval_batch_size=b, report_to=[], use_cpu=True,
                        bf16=False, max_length=64, disable_tqdm=True, beta=0.1, gradient_checkpointing=False)
        return cls(model=model, ref_model=ref, args=args, train_dataset=data, eval_dataset=data,
                   processing_class=tok).evaluate()["eval_loss"]

    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        ours = [evaluate(AccumDPOTrainer, AccumDPOConfig, b) for b in (1, 3, 8)]
    per_pair_mean = evaluate(DPOTrainer, DPOConfig, 1)
    assert max(abs(x - per_pair_mean) for x in ours) <= 1e-6 * per_pair_mean
    assert abs(per_pair_mean - math.log(2)) > 1e-3 and "transformers' value" not in caplog.text


def test_planning_the_eval_batch_leaves_trls_eval_metrics_alone(tmp_path):
    """The eval batch is measured with real evaluation steps; TRL's trainers record metrics (rewards, accuracies) in
    every step they run, so without care the measuring steps were averaged into the first evaluation's metrics. A
    planned evaluation reports what a plain one at the same eval batch reports, every metric."""
    from hf_accum import tiny
    from hf_accum.trl import AccumDPOConfig, AccumDPOTrainer
    from tests.integrations.test_dpo import preference_data

    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    ref = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    data = preference_data(21)

    def evaluate(**kw):
        args = AccumDPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, max_length=64,
                              disable_tqdm=True, beta=0.1, gradient_checkpointing=False, **kw)
        trainer = AccumDPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, eval_dataset=data,
                                  processing_class=tok)
        return trainer.evaluate(), trainer.args.per_device_eval_batch_size

    planned, batch = evaluate(auto_eval_batch_size=True, memory_budget_bytes=2**30, per_device_eval_batch_size=2)
    plain, _ = evaluate(auto_eval_batch_size=False, per_device_eval_batch_size=batch)
    assert batch > 2  # measured and raised
    keys = [k for k in plain if k.startswith(("eval_rewards/", "eval_logps/", "eval_logits/"))]
    assert keys and set(planned) >= set(keys)
    for key in keys + ["eval_loss"]:
        assert planned[key] == pytest.approx(plain[key], rel=1e-9, abs=1e-12), key


@TORCHRUN
@pytest.mark.slow
def test_two_ranks_give_the_single_process_token_mean(tmp_path):
    from tests.launch import launch

    proc = launch("ddp_eval_worker.py", "--out", tmp_path, "1", "3", "8", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    import json

    got = json.loads((tmp_path / "eval_loss.json").read_text())
    want = reference(eval_model(), eval_data())
    for b in (1, 3, 8):  # 21 rows on 2 ranks: at 3 and 8 the last batches hold rows accelerate repeats
        assert abs(got[f"accum:{b}"] - want) <= 1e-12, (b, got)
        # a compute_loss with a collective in it (TRL): every rank cuts its last batch alike, nothing hangs
        assert abs(got[f"collective:{b}"] - want) <= 1e-12, (b, got)
    assert max(abs(got[f"transformers:{b}"] - want) for b in (1, 3, 8)) > 1e-4
    # an OOM on rank 1 alone: 1 failed + 2 halves of its first batch, then its last batch (repeated rows) cut at
    # the row where rank 0 cuts its own (21 - 16 = 5) and the 4 that fitted: 8 rows -> 4 + 1 + 3
    assert abs(got["oom:8"] - want) <= 1e-12
    assert json.loads((tmp_path / "oom_forwards_rank1.json").read_text()) == 6
    # auto_eval_batch_size: rank 1 fits at most 3, so both ranks evaluate at 3 (one agreed eval batch)
    assert [json.loads((tmp_path / f"auto_batch_rank{r}.json").read_text()) for r in (0, 1)] == [3, 3]
    assert abs(got["auto"] - want) <= 1e-12
