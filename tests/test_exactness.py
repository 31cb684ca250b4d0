"""The headline invariant: micro-batch b x accumulation k gives the gradient (and logged loss) of one pass
over all b*k samples, on padded variable-length data, whatever the model or loss code (float64)."""

import pytest
from transformers import Trainer

from hf_accum import AccumTrainer

from .exactness import CASES, lm_examples, run_case

TOL = 1e-6


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_equals_one_big_batch(name, tmp_path):
    err, logged, ref_losses, trainer = run_case(CASES[name], AccumTrainer, str(tmp_path))
    windows = [len(w) for w in trainer.windows]
    assert windows == [4, 2], "16 samples / micro 3 = 6 micro-batches: a full window then a shorter last one"
    assert err <= TOL, f"{name}: relative gradient error {err:.3e}"
    assert logged == pytest.approx(ref_losses, rel=1e-6)


def test_micro_batches_really_differ_in_length_and_label_count(tmp_path):
    # The invariant is only meaningful when micro-batches are padded differently and carry different counts.
    _, _, _, trainer = run_case(CASES["causal_lm"], AccumTrainer, str(tmp_path))
    micro = [b for w in trainer.windows for b in w]
    assert len({b["input_ids"].shape[1] for b in micro}) >= 3
    counts = [int(b["labels"][:, 1:].ne(-100).sum()) for b in micro]
    assert max(counts) >= 2 * min(counts)


def test_plain_trainer_is_wrong_where_we_are_exact(tmp_path):
    # transformers' Trainer with a tutorial-style compute_loss: its loss is ~k times too large.
    err, logged, ref_losses, _ = run_case(CASES["compute_loss_override_mean"], Trainer, str(tmp_path))
    assert err > 0.5
    assert logged[0] > 2 * ref_losses[0]


def test_model_mode_is_transformers_behaviour(tmp_path):
    case = CASES["compute_loss_override_mean"]
    import dataclasses

    case = dataclasses.replace(case, normalization="model")
    err_model, logged_model, _, _ = run_case(case, AccumTrainer, str(tmp_path / "a"))
    err_plain, logged_plain, _, _ = run_case(case, Trainer, str(tmp_path / "b"))
    assert err_model == pytest.approx(err_plain, rel=1e-6)
    assert logged_model == pytest.approx(logged_plain, rel=1e-9)


def test_target_batch_size_and_single_window(tmp_path):
    err, logged, ref_losses, trainer = run_case(
        CASES["causal_lm"], AccumTrainer, str(tmp_path), micro=2, accum=3, target_batch_size=6, auto_tune=False
    )
    assert err <= TOL
    assert [len(w) for w in trainer.windows] == [3, 3, 2]
    assert len(lm_examples(16, seed=1)) == 16
