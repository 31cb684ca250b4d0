"""`trainer.check_accumulation()` on the user's real model and data: it measures, it flags a wrong loss, and it
leaves no trace (gradients, weights, buffers, RNG)."""

import logging
import random

import torch

from hf_accum import AccumTrainer, AccumTrainingArguments
from tests.exactness import MeanCrossEntropyLoss, lm_examples, pad_collate, tiny_llama


def make_trainer(tmp_path, cls=AccumTrainer, micro=6, dtype=torch.float64, **kw):
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=micro, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, remove_unused_columns=False, **kw,
    )
    model = tiny_llama(dtype=dtype, attention_dropout=0.3)  # dropout must be switched off by the check
    return cls(model=model, args=args, train_dataset=lm_examples(24, seed=5), data_collator=pad_collate)


def test_check_passes_and_restores_everything(tmp_path):
    trainer = make_trainer(tmp_path)
    model = trainer.model
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    planted = {n: torch.randn_like(p) for n, p in list(model.named_parameters())[:3]}
    for n, p in model.named_parameters():
        p.grad = planted[n].clone() if n in planted else None
    model.eval()
    torch.manual_seed(123)
    random.seed(7)
    cpu_rng, py_rng = torch.get_rng_state(), random.getstate()

    result = trainer.check_accumulation(num_micro_batches=3)

    assert result.passed and result.relative_error < 1e-6, str(result)
    assert sum(result.micro_batch_sizes) == result.one_pass_size == 6
    assert max(result.micro_batch_sizes) <= 6  # never more samples in one pass than the planned micro-batch
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n])
        assert (p.grad is None) if n not in planted else torch.equal(p.grad, planted[n])
    assert not model.training
    assert torch.equal(torch.get_rng_state(), cpu_rng) and random.getstate() == py_rng
    assert model.model.layers[0].self_attn.attention_dropout == 0.3


def test_check_flags_a_loss_that_is_k_times_too_large(tmp_path, caplog):
    # In "model" mode transformers keeps a tutorial-style mean loss un-normalized across micro-batches.
    trainer = make_trainer(tmp_path, cls=type("User", (MeanCrossEntropyLoss, AccumTrainer), {}),
                           loss_normalization="model")
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        result = trainer.check_accumulation(num_micro_batches=3)
    assert not result.passed and result.relative_error > 0.5
    assert "MISMATCH" in caplog.text
    assert "Why: loss_normalization='model' leaves the loss as transformers scales it" in caplog.text


class PairedLoss:
    """A loss one term of which spans two rows (row i with row B/2 + i), declared as nothing: cut by rows."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        score = logits[:, -1].logsumexp(-1)
        first, second = score.chunk(2)
        return torch.nn.functional.logsigmoid(first - second).neg().mean()


def test_a_mismatch_says_why(tmp_path, caplog):
    trainer = make_trainer(tmp_path, cls=type("Paired", (PairedLoss, AccumTrainer), {}),
                           loss_normalization="samples")
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        result = trainer.check_accumulation(num_micro_batches=3)
    assert not result.passed and result.relative_error > 1e-3
    assert ("Why: the batch was cut into whole samples and each forward weighted by its samples "
            "(loss_normalization='samples'), so the loss is not a mean of per-sample terms over them; if one loss "
            "term spans several rows") in caplog.text
    assert "Paired computes its own loss: it must return the mean over its batch's samples" in caplog.text


def test_same_user_code_is_exact_with_tokens_mode(tmp_path):
    trainer = make_trainer(tmp_path, cls=type("User", (MeanCrossEntropyLoss, AccumTrainer), {}))
    assert trainer.check_accumulation(num_micro_batches=3).relative_error < 1e-6


def test_float32_tolerance_and_flag_runs_it_at_train_start(tmp_path, caplog):
    trainer = make_trainer(tmp_path, dtype=torch.float32, check_accumulation=True, max_steps=1)
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        trainer.train()
    assert "accumulation check OK" in caplog.text
    assert "tolerance 1e-04" in caplog.text


def test_a_passing_check_says_one_line_and_its_figure_joins_the_first_training_log_entry(tmp_path, caplog):
    """Issue 42 item 15: check_accumulation=True said nothing when it passed (INFO) and logged nothing."""
    trainer = make_trainer(tmp_path, check_accumulation=True, max_steps=2, logging_steps=1)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):  # what a user sees without configuring logging
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "accumulation check" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("hf_accum: accumulation check OK: ")
    figure = float(said[0].split("relative gradient error ")[1].split()[0])
    history = trainer.state.log_history
    entries = [h for h in history if "accumulation_check_relative_error" in h]
    assert entries == [history[0]] and "loss" in history[0]  # no entry of its own: the first training entry
    assert f"{history[0]['accumulation_check_relative_error']:.3e}" == f"{figure:.3e}" and figure < 1e-6
    assert [h["step"] for h in history if "loss" in h] == [1, 2]


def test_micro_batch_of_one_is_skipped_with_reason(tmp_path):
    result = make_trainer(tmp_path, micro=1).check_accumulation()
    assert result.skipped_reason and "1 sample" in result.skipped_reason


def test_bf16_check_runs_under_trainings_autocast(tmp_path):
    # A float32 model with bf16=True trains under autocast: the check must measure that (errors of ~1e-3), not a
    # float32 figure (~1e-7) from running outside it.
    trainer = make_trainer(tmp_path, dtype=torch.float32, bf16=True)
    result = trainer.check_accumulation(num_micro_batches=3)
    assert result.passed and result.tolerance == 5e-2
    assert 1e-5 < result.relative_error < 5e-2, str(result)


def test_extractive_qa_with_dynamic_padding_is_not_a_false_mismatch(tmp_path):
    # QA's span softmax runs over every position: trimming a chunk's padding would change the loss, so the engine
    # keeps the width for per-sample labels and the check compares accumulation arithmetic alone.
    from transformers import LlamaConfig, LlamaForQuestionAnswering

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    model = LlamaForQuestionAnswering(cfg).double()
    g = random.Random(3)
    data = []
    for _ in range(12):
        n = g.randint(4, 30)
        start = g.randrange(n)
        data.append({"input_ids": [g.randint(1, 96) for _ in range(n)], "start_positions": start,
                     "end_positions": g.randint(start, n - 1)})

    def collate(examples):
        width = max(len(e["input_ids"]) for e in examples)
        return {
            "input_ids": torch.tensor([e["input_ids"] + [0] * (width - len(e["input_ids"])) for e in examples]),
            "attention_mask": torch.tensor([[1] * len(e["input_ids"]) + [0] * (width - len(e["input_ids"]))
                                            for e in examples]),
            "start_positions": torch.tensor([e["start_positions"] for e in examples]),
            "end_positions": torch.tensor([e["end_positions"] for e in examples]),
        }

    args = AccumTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=6, report_to=[], use_cpu=True,
                                  remove_unused_columns=False, loss_normalization="samples",
                                  label_names=["start_positions", "end_positions"])
    trainer = AccumTrainer(model=model, args=args, train_dataset=data, data_collator=collate)
    result = trainer.check_accumulation(num_micro_batches=3)
    assert result.passed and result.relative_error < 1e-6, str(result)
