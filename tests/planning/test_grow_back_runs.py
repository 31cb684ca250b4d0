"""Growing back after an OOM lowered the plan (issue 31), on real runs: tiny float64 Llama on CPU, OOMs injected by a
forward pre-hook. The plan returns after grow_back_steps clean optimizer steps, the wait doubles per recurrence, and
the weights equal those of a run that never ran out of memory. (When, as a table: tests/planning/test_growback.py.)"""

import logging

import pytest
import torch
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.probing.plan import Plan, plan_for_micro
from tests.exactness import lm_examples, max_relative_error, pad_collate, reference_run, sum_over_items_loss, tiny_llama
from tests.window.test_token_budget import run as token_run

# One xdist worker runs these tests (--dist loadgroup): `clean` is built once, not on each.
pytestmark = pytest.mark.xdist_group("test_grow_back_runs")


class Forwards:
    """Forward pre-hooks on the model: raise an injected OOM where ``oom(step, rows)`` says so (step is 1-based),
    else record the rows of each training forward that ran, per optimizer step."""

    def __init__(self, trainer, oom=None):
        self.trainer, self.oom, self.ooms, self.rows = trainer, oom, [], {}
        trainer.model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if not module.training:
            return
        step, rows = self.trainer.state.global_step + 1, int(kwargs["input_ids"].shape[0])
        if self.oom is not None and self.oom(step, rows, self.ooms):
            self.ooms.append(step)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        self.rows.setdefault(step, []).append(rows)


def run(tmp_path, oom=None, steps=40, tuned=True, **kw):
    """Target 8 on one process. Tuned: the plan 1 forward of 8 rows (applied as the tuner would, without the probe);
    else the user's micro 4 x accumulation 2 as loaded."""
    batch = {} if tuned else {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), target_batch_size=8, auto_tune=tuned, max_steps=steps, learning_rate=1e-3,
        max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, remove_unused_columns=False, **batch, **kw)
    trainer = AccumTrainer(model=tiny_llama(), args=args, train_dataset=lm_examples(64, seed=4),
                           data_collator=pad_collate, compute_loss_func=sum_over_items_loss)
    trainer.remove_callback(PrinterCallback)
    if tuned:
        trainer.apply_plan(plan_for_micro(8, 1, 8))
    forwards = Forwards(trainer, oom)
    trainer.train()
    return trainer, forwards


def once_at_step_3(step, rows, ooms):
    return step == 3 and not ooms


def above_4_rows_from_step_3(step, rows, ooms):
    return step >= 3 and rows > 4


def update_error(hit, clean) -> float:
    """Relative difference of the weights' update from the initial model (float64)."""
    start = dict(tiny_llama().named_parameters())
    got, want = dict(hit.model.named_parameters()), dict(clean.model.named_parameters())
    num = sum(float((got[n] - want[n]).detach().pow(2).sum()) for n in start)
    den = sum(float((want[n] - start[n]).detach().pow(2).sum()) for n in start)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    trainer, forwards = run(tmp_path_factory.mktemp("clean"))
    assert all(rows == [8] for rows in forwards.rows.values()) and len(forwards.rows) == 40
    return trainer


def test_one_oom_at_step_3_is_back_on_the_probed_plan_after_16_clean_steps(tmp_path, clean, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        hit, forwards = run(tmp_path, once_at_step_3)
    assert forwards.ooms == [3]
    per_step = [forwards.rows[step] for step in range(1, 41)]
    # steps 1-2 on the plan, 3 (re-run) to 19 lowered to 2 forwards, 16 clean steps (4..19), then back
    assert per_step == [[8]] * 2 + [[4, 4]] * 17 + [[8]] * 21
    assert ("hf_accum: 16 clean steps since the out-of-memory error at step 2; back to micro 8 × accumulation 1 × "
            "world 1 = 8") in caplog.text
    assert hit.plan == plan_for_micro(8, 1, 8) and hit.state.global_step == 40
    assert update_error(hit, clean) <= 1e-6


def test_a_recurring_oom_strikes_twice_in_40_steps_and_the_weights_equal_a_clean_run(tmp_path, clean, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        hit, forwards = run(tmp_path, above_4_rows_from_step_3)
    # grown back after step 19, out of memory again at 20: the wait doubles to 32 steps (past step 40)
    assert forwards.ooms == [3, 20]
    assert caplog.text.count("clean steps since the out-of-memory error") == 1
    assert [forwards.rows[step] for step in range(1, 41)] == [[8]] * 2 + [[4, 4]] * 38
    assert hit.planner.growback.wait == 32 and hit.plan.micro_batch_size == 4
    assert update_error(hit, clean) <= 1e-6


def test_grow_back_steps_0_keeps_the_lowered_plan(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        hit, forwards = run(tmp_path, once_at_step_3, steps=24, grow_back_steps=0)
    assert forwards.ooms == [3] and "clean steps since" not in caplog.text
    assert [forwards.rows[step] for step in range(3, 25)] == [[4, 4]] * 22
    assert hit.plan.micro_batch_size == 4


def test_micro_batches_the_user_set_grow_back_too(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        hit, forwards = run(tmp_path, lambda step, rows, ooms: step == 3 and rows > 2 and not ooms, steps=8,
                            tuned=False, grow_back_steps=2)
    assert forwards.ooms == [3]
    # micro 4 x 2 as loaded; the OOM cuts each loaded batch in 2 (micro 2 x 4); 2 clean steps (4, 5), then back
    assert [forwards.rows[step] for step in range(1, 9)] == [[4, 4]] * 2 + [[2, 2, 2, 2]] * 3 + [[4, 4]] * 3
    assert "2 clean steps since the out-of-memory error at step 2; back to micro 4 × accumulation 2" in caplog.text
    assert hit.plan == Plan(4, 2, 1, 8) and hit._engine.cut_units is None
    assert (hit.args.per_device_train_batch_size, hit.args.gradient_accumulation_steps) == (4, 2)
    clean, _ = run(tmp_path / "clean", steps=8, tuned=False)
    assert update_error(hit, clean) <= 1e-6


def test_a_token_budget_grows_back_and_stays_exact(tmp_path, caplog):
    # 96 samples, windows of 16: 6 steps; an OOM in step 1 lowers 96 tokens to 72; 2 clean steps, then 96 again
    with caplog.at_level(logging.INFO, logger="hf_accum"):
        trainer, rec, shapes = token_run(tmp_path, oom_calls=(2,), n=96, grow_back_steps=2)
    assert "cut into forwards of at most 72 tokens" in caplog.text
    assert ("2 clean steps since the out-of-memory error at step 0; back to window 16 × world 1 = 16, cut into "
            "forwards of at most 96 tokens") in caplog.text
    assert trainer.plan.token_budget == 96 and trainer._engine.token_budget.tokens == 96
    ref = reference_run(tiny_llama(), rec, trainer.windows, "causal")
    assert max_relative_error(rec.grads, ref.grads) <= 1e-6
