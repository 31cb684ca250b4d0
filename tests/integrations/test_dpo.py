"""`AccumDPOTrainer`: preference batches are cut into whole pairs (row i with row B+i), the loss is the mean over
the window's pairs, and an OOM mid-window re-runs it exactly. The reference is independent: per-token
log-probabilities from one forward over each recorded batch, DPO's sigmoid loss written out by hand, float64."""

import logging

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from hf_accum import tiny  # noqa: E402
from hf_accum.trl import AccumDPOConfig, AccumDPOTrainer  # noqa: E402
from tests.exactness import StepRecorder, load_weights, max_relative_error, recording  # noqa: E402
from tests.trainer.test_oom_recovery import OOMAt  # noqa: E402

BETA = 0.1


def preference_data(n=20, seed=0):
    rows = tiny.generate_instruction_data(n, seed=seed)
    # rejected: the response reversed (a plausible-looking but wrong completion of another length)
    return Dataset.from_list([{"prompt": r["prompt"], "chosen": r["response"],
                               "rejected": r["response"][::-1] + " no"} for r in rows])


def dpo_run(tmp_path, micro, accum, *, oom_calls=(), n=20, **overrides):
    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    args = AccumDPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        target_batch_size=micro * accum, auto_tune=False, num_train_epochs=1, learning_rate=1e-2,
        max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
        disable_tqdm=True, beta=BETA, precompute_ref_log_probs=True, max_length=64, gradient_checkpointing=False,
        **overrides,
    )
    recorder = StepRecorder()
    trainer = recording(AccumDPOTrainer)(model=model, args=args, train_dataset=preference_data(n),
                                         processing_class=tok, callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]) if m.training else None,
                                    with_kwargs=True)
    # raised inside a decoder layer's forward, with the earlier layers' activations alive
    injector = OOMAt(model.model.layers[1], oom_calls) if oom_calls else None
    trainer.train()
    return trainer, recorder, seen, injector


def sequence_logps(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits.double(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (logp * batch["completion_mask"][:, 1:]).sum(1)


def reference_grads(trainer, recorder):
    """Each step: mean over all of the window's pairs of -logsigmoid(beta * (policy - reference log-ratio))."""
    # A fresh model (TRL patches the trained one's forward with closures that a deepcopy would still share);
    # every parameter is overwritten with the recorded weights below.
    model = tiny.build_model("causal_lm", tokenizer=tiny.build_tokenizer(), dtype=torch.float64, hidden_size=32)
    out = []
    for weights, window in zip(recorder.weights, trainer.windows):
        load_weights(model, weights)
        model.zero_grad(set_to_none=True)
        terms = []
        for b in window:
            chosen, rejected = sequence_logps(model, b).chunk(2)
            delta = (chosen - b["ref_chosen_logps"]) - (rejected - b["ref_rejected_logps"])
            terms.append(-F.logsigmoid(BETA * delta))
        torch.cat(terms).mean().backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return out


def max_error(recorder, ref):
    return max_relative_error(recorder.grads, ref)


def test_dpo_is_exact_over_the_window_including_a_shorter_last_one(tmp_path):
    trainer, recorder, _, _ = dpo_run(tmp_path, micro=3, accum=2)  # 20 pairs: windows of 6, 6, 6, 2
    assert [sum(b["input_ids"].shape[0] // 2 for b in w) for w in trainer.windows] == [6, 6, 6, 2]
    assert max_error(recorder, reference_grads(trainer, recorder)) <= 1e-6


def test_oom_mid_window_reruns_whole_pairs_exactly(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer, recorder, seen, injector = dpo_run(tmp_path, micro=4, accum=2, oom_calls=(3,), n=16)
    assert "out of memory at step 1" in caplog.text and trainer.plan.micro_batch_size == 2
    # window 1: two forwards of 4 pairs (8 rows); window 2's first forward (the 3rd) runs out of memory; from then
    # on every forward holds 2 whole pairs (4 rows)
    assert seen[:3] == [8, 8, 8] and set(seen[3:]) == {4} and len(seen) == 3 + 4
    for w in trainer.windows:  # the loaded batches are still [chosen; rejected] of 4 pairs
        for b in w:
            assert b["input_ids"].shape[0] == 8
    assert max_error(recorder, reference_grads(trainer, recorder)) <= 1e-6


def test_check_accumulation_ok_on_pairs(tmp_path):
    tok = tiny.build_tokenizer()
    model = tiny.build_model("causal_lm", tokenizer=tok, dtype=torch.float64, hidden_size=32)
    args = AccumDPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True, bf16=False,
                          report_to=[], precompute_ref_log_probs=True, max_length=64, gradient_checkpointing=False)
    trainer = AccumDPOTrainer(model=model, args=args, train_dataset=preference_data(8), processing_class=tok)
    result = trainer.check_accumulation(num_micro_batches=2)
    assert result.passed and result.relative_error < 1e-6 and result.micro_batch_sizes == [2, 2]


@pytest.mark.parametrize("loss_type", [["aot"], ["aot_unpaired"], ["bco_pair"], ["sigmoid", "bco_pair"]])
def test_losses_that_are_not_per_pair_means_are_refused(tmp_path, loss_type):
    with pytest.raises(ValueError, match=r"is not a mean of per-pair terms.*loss_type=\['sigmoid'\]"):
        AccumDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_type=loss_type)


def test_tokens_mode_is_refused_with_dpo_advice(tmp_path):
    with pytest.raises(ValueError, match="mean over preference pairs.*loss_normalization='samples'"):
        AccumDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, loss_normalization="tokens")


def sft_reference_grads(trainer, recorder, weights):
    """Each step: weights["sigmoid"] x the mean over the window's pairs of DPO's sigmoid term + weights["sft"] x the
    token mean, over every chosen completion token of the window, of its negative log-likelihood (float64)."""
    model = tiny.build_model("causal_lm", tokenizer=tiny.build_tokenizer(), dtype=torch.float64, hidden_size=32)
    out = []
    for step_weights, window in zip(recorder.weights, trainer.windows):
        load_weights(model, step_weights)
        model.zero_grad(set_to_none=True)
        pair_terms, nll, tokens = [], 0.0, 0
        for b in window:
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
            logp = torch.log_softmax(logits.double(), -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
            mask = b["completion_mask"][:, 1:]
            chosen, rejected = (logp * mask).sum(1).chunk(2)
            delta = (chosen - b["ref_chosen_logps"]) - (rejected - b["ref_rejected_logps"])
            pair_terms.append(-F.logsigmoid(BETA * delta))
            half = b["input_ids"].shape[0] // 2
            nll = nll - (logp[:half] * mask[:half]).sum()
            tokens += int(mask[:half].sum())
        loss = weights.get("sigmoid", 0.0) * torch.cat(pair_terms).mean() + weights["sft"] * nll / tokens
        loss.backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return out


@pytest.mark.parametrize("weights, oom", [({"sft": 1.0}, ()), ({"sigmoid": 1.0, "sft": 0.5}, ()),
                                          ({"sigmoid": 1.0, "sft": 0.5}, (3,))])
def test_the_sft_loss_is_the_token_mean_over_the_window(tmp_path, weights, oom):
    # 20 pairs in windows of 3 x 2 pairs (the last one 2); with an OOM: micro 4 x 2 cut to 2 pairs per forward.
    # Pair means and token means differ here (completions of different lengths), so a pair-weighted sft term fails.
    micro, n = (4, 16) if oom else (3, 20)
    trainer, recorder, _, _ = dpo_run(tmp_path, micro=micro, accum=2, n=n, oom_calls=oom,
                                      loss_type=list(weights), loss_weights=list(weights.values()))
    assert max_error(recorder, sft_reference_grads(trainer, recorder, weights)) <= 1e-6
