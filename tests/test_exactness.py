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


def test_an_uneven_cut_of_a_prime_target_equals_one_pass(tmp_path):
    """Target 7 where the probe may use at most 3 rows: 3 forwards (2 + 2 + 3) per window, not 7 forwards of one;
    the last window (16 = 7 + 7 + 2) is one forward of 2. Every step equals one float64 pass over its samples."""
    err, logged, ref_losses, trainer = run_case(
        CASES["causal_lm"], AccumTrainer, str(tmp_path), micro=1, accum=1, target_batch_size=7, probe_max_micro_batch=3,
        forward_sizes=True,
    )
    plan = trainer.plan
    assert (plan.micro_batch_size, plan.forwards) == (3, 3)
    assert plan.describe().startswith("window 7 × world 1 = 7, 3 forwards of ≤ 3 rows")
    assert [sum(int(b["input_ids"].shape[0]) for b in w) for w in trainer.windows] == [7, 7, 2]
    sizes = trainer.forward_sizes.sizes
    assert sorted(sizes[0:3]) == [2, 2, 3] and sorted(sizes[3:6]) == [2, 2, 3] and sizes[6:] == [2]
    assert err <= TOL, f"relative gradient error {err:.3e}"
    assert logged == pytest.approx(ref_losses, rel=1e-6)
