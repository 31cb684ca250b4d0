"""micro_batching="tokens": the same samples and windows as "samples", each window loaded whole, sorted by length
and cut into the fewest forwards under a token budget — exact against an independent reference (one pass over
the window, or each sequence alone, float64), for padded and padding-free batches, and after an OOM that lowers
the budget. The partition rule itself is checked by table and by brute force."""

import logging
import math
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis.strategies import floats as st_floats
from hypothesis.strategies import integers as st_integers
from hypothesis.strategies import lists as st_lists
from transformers import DataCollatorWithFlattening
from transformers.trainer_callback import PrinterCallback

from hf_accum import AccumTrainer, AccumTrainingArguments
from hf_accum.levers import kernels
from hf_accum.probing.plan import plan_batch
from hf_accum.probing.step_timing import sizes
from hf_accum.window.kernel_budget import cut_figures, data_windows
from hf_accum.window.token_budget import (
    PADDING_TARGET,
    TokenBudget,
    TooLongForBudget,
    candidate_cuts,
    cost_model,
    fewest_groups,
    fit_step_time,
    modelled_seconds,
    padded_tokens,
    partition_packed,
    partition_padded,
    plan_budget,
    predicted_peak,
    step_time_rule,
)
from tests.exactness import (
    StepRecorder,
    lm_examples,
    max_relative_error,
    pad_collate,
    recording,
    reference_run,
    tiny_llama,
)
from tests.trainer.test_oom_recovery import OOMAt
from tests.window.by_hand import contiguous_cuts, least_score
from tests.window.test_padding_free import reference_grads as flat_reference

TORCHRUN = pytest.mark.xdist_group("torchrun")  # the multi-rank tests share one pytest-xdist worker: two
# two-rank runs at once on 2 cores were seen to hang. The file's one-process tests go to either worker.


# --- the partition rule -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths, budget, groups", [
    ([10, 10, 10, 10], 40, 1),
    ([10, 10, 10, 10], 39, 2),
    ([50, 5, 5, 5, 5, 5, 5, 5, 5], 50, 2),  # the long one alone, the eight short ones together
    ([3, 9, 27], 27, 2),  # 27 alone; 9 and 3 padded to 9
])
def test_fewest_groups_table(lengths, budget, groups):
    assert fewest_groups(lengths, budget) == groups
    parts = partition_padded(lengths, TokenBudget(budget, padding_target=None))  # the fewest, whatever they pad
    assert len(parts) == groups and sorted(i for g in parts for i in g) == list(range(len(lengths)))
    assert all(len(g) * max(lengths[i] for i in g) <= budget for g in parts)


def modelled(tokens, short=4, long=20, per_token=10.0, per_token_sq=2.0, usable=900.0):
    """A TokenBudget whose cost model (measured at ``short`` and ``long``) admits more rows between them."""
    rows_at = {str(n): int(usable // (per_token * n + per_token_sq * n * n)) for n in (short, long)}
    return TokenBudget(tokens, {"lengths": [short, long], "rows_at": rows_at, "usable_bytes": usable,
                                "per_token_bytes": per_token, "per_token_sq_bytes": per_token_sq, "base_bytes": 0.0})


@pytest.mark.parametrize("kind", ["tokens", "cost model"])
@pytest.mark.parametrize("target", [None, PADDING_TARGET])
def test_partition_is_optimal_by_brute_force(kind, target):
    # every partition of the sorted rows into contiguous groups, scored: the fewest groups, more while the least
    # padding at that many exceeds the target and "samples" mode's count allows, then the least padding
    g = random.Random(0)
    for _ in range(60):
        lengths = [g.randint(1, 20) for _ in range(g.randint(1, 7))]
        budget = g.randint(max(lengths), 60)
        if kind == "cost model":
            budget = modelled(max(lengths))
        rows = budget.rows if kind == "cost model" else (lambda n, b=budget: b // n)
        parts = partition_padded(lengths, replace(budget, padding_target=target) if kind == "cost model"
                                 else TokenBudget(budget, padding_target=target))
        least = {}  # group count -> least padded tokens
        for groups in contiguous_cuts(lengths):
            if all(len(gr) <= rows(max(lengths[i] for i in gr)) for gr in groups):
                least[len(groups)] = min(least.get(len(groups), 1 << 30), padded_tokens(lengths, groups))
        k = min(least)
        most = max(k, -(-len(lengths) // rows(max(lengths))))
        while target is not None and k < most and least[k] > target * sum(lengths):
            k += 1
        assert (len(parts), padded_tokens(lengths, parts)) == (k, least[k])


@pytest.mark.parametrize("lengths, budget, target, groups, padded", [
    ([2, 2, 6, 10, 10], 20, None, 2, 38),  # no target: the fewest forwards, [6, 2, 2] and [10, 10] (38/30 = 1.27)
    ([2, 2, 6, 10, 10], 20, 1.10, 3, 30),  # over the target: a third forward, [2, 2], [6], [10, 10], no padding
    ([2, 2, 6, 10, 10], 20, 1.30, 2, 38),  # 1.27 is within a target of 1.30
    ([2, 2, 10, 2, 2], 50, 1.10, 1, 50),   # 5 rows fit at length 10: one micro-batch sized for the longest row
    ([9, 10, 10, 10], 40, 1.10, 1, 40),    # takes them all ("samples" mode's count): never more forwards than that
    ([1, 1, 1, 1, 1, 1, 40, 40], 80, 1.10, 2, 86),  # the fewest forwards pad nothing: [1 x 6], [40, 40]
    ([1, 1, 1, 1, 1, 1, 40, 40], 40, 1.10, 3, 86),  # one row of 40 per forward: [1 x 6], [40], [40]
])
def test_more_forwards_only_while_the_padding_exceeds_the_target(lengths, budget, target, groups, padded):
    parts = partition_padded(lengths, TokenBudget(budget, padding_target=target))
    assert len(parts) == groups and padded_tokens(lengths, parts) == padded
    assert sorted(i for gr in parts for i in gr) == list(range(len(lengths)))


def lognormal_windows(n_windows=32, window=64, longest=512, seed=0):
    """Long-tailed SFT lengths (benchmarks/bench_token_budget.py's): lognormal, median 60, clipped to [8, 512],
    every 256th example at the longest; cut into windows of a fixed shuffle."""
    g = random.Random(seed)
    lens = [min(longest, max(8, round(60 * math.exp(g.gauss(0, 1.0))))) for _ in range(n_windows * window)]
    lens[::256] = [longest] * len(lens[::256])
    random.Random(1).shuffle(lens)
    return [lens[w:w + window] for w in range(0, len(lens), window)]


def test_long_tailed_windows_pad_at_most_the_target_deterministically_and_within_samples_modes_forwards():
    budget = 4 * 512  # 4 rows of the longest example: "samples" mode runs micro 4, 16 forwards per window of 64
    windows = lognormal_windows()
    real = sum(map(sum, windows))
    now = [partition_padded(w, budget) for w in windows]
    fewest = [partition_padded(w, TokenBudget(budget, padding_target=None)) for w in windows]
    for w, parts, few in zip(windows, now, fewest):
        assert sorted(i for gr in parts for i in gr) == list(range(len(w)))  # every row once, none split
        assert all(len(gr) * max(w[i] for i in gr) <= budget for gr in parts)  # each forward within the budget
        assert len(few) <= len(parts) <= 16  # never more forwards than "samples" mode
        assert padded_tokens(w, parts) <= PADDING_TARGET * sum(w)
        # the same lengths in another order: the same cut (as lengths); the same call twice: the same indices
        shuffled = w[::-1]
        again = partition_padded(shuffled, budget)
        assert (sorted(sorted(shuffled[i] for i in gr) for gr in again)
                == sorted(sorted(w[i] for i in gr) for gr in parts))
        assert partition_padded(list(w), budget) == parts
    padded_now = sum(padded_tokens(w, p) for w, p in zip(windows, now)) / real
    padded_before = sum(padded_tokens(w, p) for w, p in zip(windows, fewest)) / real
    assert padded_now <= PADDING_TARGET < 1.2 < padded_before  # the fewest forwards pad ~1.28 on this data
    assert sum(map(len, now)) < 0.65 * 16 * len(windows)


@pytest.mark.parametrize("length, rows", [
    (2, 10),    # shorter than the measured lengths: the token floor only (20 // 2)
    (4, 12),    # measured: the rows measured to fit there (900 // 72)
    (8, 4),     # between: the model's prediction, 900 // (80 + 128), above the floor's 2
    (20, 1),    # measured (0 rows by the model; the floor holds one)
    (30, 0),    # beyond: the floor (20 // 30)
])
def test_a_cost_model_admits_more_rows_only_between_the_measured_lengths(length, rows):
    budget = modelled(20)
    assert budget.rows(length) == rows
    smaller = budget.scaled(0.75)
    assert smaller.tokens == 15 and smaller.rows(length) <= rows
    assert str(budget) == "20"


def test_forced_group_counts_and_refusals():
    assert len(partition_padded([5, 5, 5, 5], 20, groups=3)) == 3  # ranks agreed on more forwards
    assert partition_packed([3, 4, 2, 5], 7) == [(0, 2), (2, 4)]
    assert len(partition_packed([3, 4, 2, 5], 100, groups=3)) == 3
    with pytest.raises(TooLongForBudget, match="an example of 30 tokens exceeds the token budget of 20"):
        partition_padded([30, 5], 20)


@pytest.mark.parametrize("per_row, per_token, per_token_sq, lengths", [
    (0.0, 4096.0, 0.0, (64, 512)),         # SDPA without a padding mask: activations only
    (0.0, 4096.0, 96.0, (64, 512)),        # eager attention's score matrices
    (50000.0, 4096.0, 96.0, (64, 181, 512)),  # three lengths pin a per-row cost too
    (0.0, 2048.0, 8.0, (300,)),            # one length: nothing separates the terms, all is per token
])
def test_the_cost_model_separates_per_row_per_token_and_quadratic_terms(per_row, per_token, per_token_sq, lengths):
    slopes = {n: per_row + per_token * n + per_token_sq * n * n for n in lengths}
    model = cost_model(1e6, slopes)
    if len(lengths) > 1:
        assert model["per_token_bytes"] == pytest.approx(per_token)
        assert model["per_token_sq_bytes"] == pytest.approx(per_token_sq, abs=1e-6)
        assert model["per_row_bytes"] == pytest.approx(per_row, abs=1e-3)
    for n in lengths:  # it reproduces the measured lines at every measured length
        assert predicted_peak(model, 3, n) == pytest.approx(1e6 + 3 * slopes[n])


def test_two_lengths_over_estimate_a_per_row_cost_between_them():
    true = {n: 50000.0 + 4096.0 * n for n in (64, 181, 512)}
    model = cost_model(0.0, {64: true[64], 512: true[512]})
    assert predicted_peak(model, 1, 181) > true[181]


# --- through the trainer ----------------------------------------------------------------------------------------
def long_tailed(n, seed=0):
    g = random.Random(seed)
    rows = lm_examples(n, seed=seed, min_len=4, max_len=12)
    for i in range(0, n, 7):  # a few long examples, as real SFT data has
        length = g.randint(40, 60)
        ids = [g.randint(1, 96) for _ in range(length)]
        rows[i] = {"input_ids": ids, "labels": [-100] * 3 + ids[3:]}
    return rows


def run(tmp_path, collator=pad_collate, budget=96, oom_calls=(), mode="tokens", n=32, micro=4, accum=4, **extra):
    model = tiny_llama()
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        target_batch_size=micro * accum, auto_tune=False, micro_batching=mode,
        max_tokens_per_forward=budget if mode == "tokens" else None, num_train_epochs=1, learning_rate=1e-2,
        max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, remove_unused_columns=False, **extra,
    )
    recorder = StepRecorder()
    trainer = recording(AccumTrainer)(model=model, args=args, train_dataset=long_tailed(n), data_collator=collator,
                                      callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    shapes = []
    model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)) if m.training
                                    else None, with_kwargs=True)
    if oom_calls:
        OOMAt(model.model.layers[1], oom_calls)
    trainer.train()
    return trainer, recorder, shapes


def test_padded_windows_cut_by_tokens_are_exact_and_use_fewer_forwards(tmp_path):
    # the budget holds 2 rows of the longest example (60 tokens): "samples" mode must run micro 2 to fit it
    tokens, rec, shapes = run(tmp_path / "tokens", budget=120)
    assert [len(w) for w in tokens.windows] == [1, 1]  # each rank's window loaded whole: 16 rows
    assert all(rows * width <= 120 for rows, width in shapes)
    ref = reference_run(tiny_llama(), rec, tokens.windows, "causal")
    assert max_relative_error(rec.grads, ref.grads) <= 1e-6
    samples, rec_s, shapes_s = run(tmp_path / "samples", mode="samples", micro=2, accum=8)
    # same samples, same windows: the same gradients, with fewer forwards and less padding
    assert max_relative_error(rec.grads, rec_s.grads) <= 1e-6
    assert len(shapes) < len(shapes_s)
    assert sum(r * w for r, w in shapes) < sum(r * w for r, w in shapes_s)


def test_windows_padding_over_the_target_get_more_forwards_and_stay_exact(tmp_path):
    # budget 180 holds 3 rows of the longest example (59 tokens): the fewest forwards pad > 1.10 x; the cut in
    # force takes more (at most "samples" mode's 6), the forwards are those of partition_padded, and the
    # gradients match the independent float64 reference (each window's CE by hand, one pass) to 1e-10
    trainer, rec, shapes = run(tmp_path, budget=180)
    expected, fewest = [], []
    for (batch,) in trainer.windows:
        lengths = batch["attention_mask"].sum(1).tolist()
        parts = partition_padded(lengths, TokenBudget(180))
        expected += sorted((len(g), max(lengths[i] for i in g)) for g in parts)
        fewest.append(len(partition_padded(lengths, TokenBudget(180, padding_target=None))))
        assert padded_tokens(lengths, parts) <= PADDING_TARGET * sum(lengths) or len(parts) == 6
    assert sorted(shapes) == sorted(expected) and len(shapes) > sum(fewest)
    ref = reference_run(tiny_llama(), rec, trainer.windows, "causal")
    assert max_relative_error(rec.grads, ref.grads) <= 1e-10


def test_padding_free_windows_cut_by_tokens_are_exact(tmp_path):
    trainer, rec, shapes = run(tmp_path, collator=DataCollatorWithFlattening(), budget=120)
    assert all(rows == 1 and width <= 120 for rows, width in shapes) and len(shapes) > 2
    assert max_relative_error(rec.grads, flat_reference(rec, trainer.windows, "tokens")) <= 1e-6


def test_oom_lowers_the_token_budget_and_reruns_the_window_exactly(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer, rec, shapes = run(tmp_path, oom_calls=(2,))
    assert "cut into forwards of at most 72 tokens" in caplog.text and trainer.plan.token_budget == 72
    ref = reference_run(tiny_llama(), rec, trainer.windows, "causal")
    assert max_relative_error(rec.grads, ref.grads) <= 1e-6


def test_tokens_seen_and_flops_count_what_the_forwards_held(tmp_path):
    # "non_padding": the real tokens of the data, as in "samples" mode; "all": the token positions the model was
    # really given (a forward hook records them), fewer than the window padded to its longest row; FLOPs follow.
    real = sum(len(row["input_ids"]) for row in long_tailed(32))
    for mode, micro, accum in (("samples", 2, 8), ("tokens", 4, 4)):
        trainer, _, _ = run(tmp_path / mode, budget=120, mode=mode, micro=micro, accum=accum,
                            include_num_input_tokens_seen="non_padding")
        assert trainer.state.num_input_tokens_seen == real
    trainer, _, shapes = run(tmp_path / "all", budget=120, include_num_input_tokens_seen="all")
    forwarded = sum(rows * width for rows, width in shapes)
    loaded = sum(b["input_ids"].numel() for window in trainer.windows for b in window)
    assert trainer.state.num_input_tokens_seen == forwarded < loaded  # loaded: each window padded whole
    per_token = 6 * trainer.model.num_parameters(exclude_embeddings=True)
    assert trainer.state.total_flos == pytest.approx(per_token * forwarded, rel=1e-12)


def test_an_example_longer_than_the_budget_is_refused_naming_it_before_training(tmp_path):
    first_long = next(i for i, row in enumerate(long_tailed(32)) if len(row["input_ids"]) > 30)
    with pytest.raises(ValueError, match=rf"train_dataset row {first_long} has \d+ tokens, more than "
                                         r"max_tokens_per_forward=30: .* Truncate examples to at most 30 tokens"):
        run(tmp_path, budget=30)
    assert not list(tmp_path.glob("checkpoint-*"))


@pytest.mark.parametrize("budget_mib", [48, 3], ids=["window-fits", "tight"])
def test_the_tuner_measures_a_token_budget_at_the_longest_and_shortest_example(tmp_path, caplog, budget_mib):
    model = tiny_llama(torch.float32)
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), target_batch_size=16, micro_batching="tokens", memory_budget_bytes=budget_mib << 20,
        max_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
    )
    trainer = AccumTrainer(model=model, args=args, train_dataset=long_tailed(32), data_collator=pad_collate)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        plan = trainer.tune()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_accum plan: "))
    assert line.startswith(f"hf_accum plan: {plan.describe()}; ")  # the one short plan line; details in the file
    expected = trainer.probe_result.extra["expected"]  # what it means for the user's data, vs "samples" mode's plan
    samples = plan_batch(16, 1, trainer.probe_result.extra["token_budget"]["rows_at_longest"])
    assert expected["samples_mode_forwards_per_step"] == samples.forwards  # 32 examples: 2 full windows of 16
    # less padding than "samples" mode; more forwards only where the probe's step times say one costs less
    # than the padding it saves
    assert expected["padded_over_real"] <= expected["samples_mode_padded_over_real"]
    assert expected["forwards_per_step"] <= expected["samples_mode_forwards_per_step"]
    # the plan line says them: forwards and padded / real tokens per step, and "samples" mode's
    assert (f"; per step {expected['forwards_per_step']:.1f} forwards, padded/real {expected['padded_over_real']:.2f} "
            f"(samples mode {expected['samples_mode_forwards_per_step']:.1f}, ") in line
    measured = trainer.probe_result.extra["token_budget"]
    longest = max(len(r["input_ids"]) for r in long_tailed(32))
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (16, 1)
    assert measured["longest"] == longest and measured["shortest"] <= longest
    if measured["rows_at_longest"] < 16:  # the window does not fit whole at the worst case: a second length
        assert measured["shortest"] < longest and measured["short_trials"]
    assert plan.token_budget == min(rows * int(length) for length, rows in measured["rows_at"].items())
    assert measured["rows_at"][str(longest)] == measured["rows_at_longest"]
    assert "cut into forwards of at most" in plan.describe()
    # one forward timed at every size from each length's largest fit down to one row, halving, and the optimizer's
    # step alone, make the step-time model the cut reads, stored in the plan (the fit of those times, not whether it
    # gives a model: on a busy machine noise can leave no forward cost > 0)
    timed = {int(length): {int(rows): s for rows, s in by_rows.items()}
             for length, by_rows in measured["step_times"].items()}
    assert all(sorted(by_rows) == sizes(measured["rows_at"][str(length)]) for length, by_rows in timed.items())
    assert measured["optimizer_step_seconds"] and all(s > 0 for s in measured["optimizer_step_seconds"])
    assert plan.step_time == fit_step_time(timed, measured["optimizer_step_seconds"]) == measured["step_time"]
    if plan.step_time is not None:
        assert "least modelled step time" in plan.describe()
    # the loss kernel and the budget chosen together: the budget measured under each kernel that runs here, and
    # the plan's the kernel whose whole steps on the user's windows model least (window/kernel_budget.py)
    if len(kernels.runnable("cpu", torch.float32)) >= 2:
        record, by_kernel = plan.levers["loss_kernel"], trainer.probe_result.extra["token_kernels"]
        assert set(record["tokens_per_forward"]) == set(by_kernel) == set(kernels.runnable("cpu", torch.float32))
        assert plan.token_budget == record["tokens_per_forward"][record["kernel"]]
        assert {k: v["tokens_per_forward"] for k, v in by_kernel.items()} == record["tokens_per_forward"]
        figures = cut_figures(data_windows([len(r["input_ids"]) for r in long_tailed(32)], 16), plan_budget(plan))
        assert record["forwards_per_step"][record["kernel"]] == pytest.approx(figures["forwards_per_step"], abs=1e-4)
        if record["by"] == "step time":
            assert record["step_seconds"][record["kernel"]] == min(record["step_seconds"].values())
        assert f"loss kernel {record['kernel']} (" in line
    # padded rows of a decoder-only model could be packed: the line says what that would take
    assert expected["padding_free_forwards_per_step"] <= expected["forwards_per_step"]
    assert f"padding-free rows (DataCollatorWithFlattening, TRL padding_free=True) would take " \
           f"{expected['padding_free_forwards_per_step']:.1f} forwards at padded/real 1.00" in line
    if measured["cost_model"] is not None:
        fitted = trainer.probe_result.fitted  # the line at the longest length, which the model reproduces
        assert predicted_peak(measured["cost_model"], 2, longest) == pytest.approx(fitted[0] + 2 * fitted[1])
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_stored_token_plan_is_reused_with_its_budget_and_cost_model(tmp_path):
    def tuned():
        args = AccumTrainingArguments(
            output_dir=str(tmp_path), target_batch_size=16, micro_batching="tokens", memory_budget_bytes=3 << 20,
            max_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
            remove_unused_columns=False)
        trainer = AccumTrainer(model=tiny_llama(torch.float32), args=args, train_dataset=long_tailed(32),
                               data_collator=pad_collate)
        return trainer, trainer.tune()

    first, plan = tuned()
    second, reused = tuned()
    assert first.probe_result is not None and second.probe_result is None  # the second run read the file
    assert reused == plan and reused.token_budget is not None and reused.token_model == plan.token_model
    # what was chosen and why (the loss kernel with the budget) comes back, and the same windows cut the same way
    assert reused.levers["loss_kernel"] == plan.levers["loss_kernel"] == first.probe_result.extra["loss_kernel"]
    windows = data_windows([len(r["input_ids"]) for r in long_tailed(32)], 16)
    assert [partition_padded(w, plan_budget(reused)) for w in windows] == \
        [partition_padded(w, plan_budget(plan)) for w in windows]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One launch of `tokens_worker.py` for both kinds of batch, each in its own folder."""
    from tests.integrations.test_ddp import _torchrun

    out = tmp_path_factory.mktemp("tokens")
    return out, _torchrun("tokens_worker.py", out, "padded", "flat", timeout=400)


@TORCHRUN
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["padded", "flat"])
def test_two_ranks_run_equally_many_forwards_and_stay_exact(two_rank_runs, kind):
    out, proc = two_rank_runs
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    tmp_path = out / kind
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["own_fewest"] != r1["own_fewest"]  # on their own the ranks would run different counts
    assert r0["forwards"] == r1["forwards"] and len(r0["forwards"]) == 3
    assert r0["forwards"] == [max(a, b) for a, b in zip(r0["own_fewest"], r1["own_fewest"])]
    recorder = StepRecorder()
    recorder.grads, recorder.weights = r0["grads"], r0["weights"]
    windows = [a + b for a, b in zip(r0["windows"], r1["windows"])]
    if kind == "flat":  # each sequence alone
        assert max_relative_error(r0["grads"], flat_reference(recorder, windows, "tokens")) <= 1e-6
    else:
        ref = reference_run(tiny_llama(), recorder, windows, "causal")
        assert max_relative_error(r0["grads"], ref.grads) <= 1e-6


def test_check_accumulation_in_tokens_mode_runs_one_forward_not_the_window(tmp_path):
    model = tiny_llama()
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=4, target_batch_size=16,
        auto_tune=False, micro_batching="tokens", max_tokens_per_forward=120, use_cpu=True, report_to=[],
        remove_unused_columns=False, check_accumulation=True, max_steps=1, save_strategy="no", disable_tqdm=True)
    trainer = AccumTrainer(model=model, args=args, train_dataset=long_tailed(32), data_collator=pad_collate)
    trainer.train()
    result = trainer.check_accumulation(num_micro_batches=2)
    assert result.passed and result.relative_error < 1e-6 and result.one_pass_size < 16


def timed_budget(tokens, fixed, per_token=1.0, at=None):
    return TokenBudget(tokens, step_time={"forward_seconds": fixed, "token_seconds": at or {"8": per_token}})


@pytest.mark.parametrize("lengths, budget, fixed, groups, padded", [
    ([2, 2, 6, 10, 10], 20, 100.0, 2, 38),  # a forward dearer than all the padding: the fewest forwards
    ([2, 2, 6, 10, 10], 20, 0.0, 3, 30),    # forwards free: the least padding, as many as "samples" mode allows
    ([2, 2, 6, 10, 10], 20, 7.0, 3, 30),    # the third forward saves 8 padded tokens for 7
    ([2, 2, 6, 10, 10], 20, 9.0, 2, 38),    # ... not for 9
    ([2, 2, 6, 10, 10], 20, 8.0, 2, 38),    # a tie: the fewer forwards
    ([9, 10, 10, 10], 40, 0.0, 1, 40),      # never more forwards than "samples" mode's count
])
def test_the_number_of_forwards_is_the_least_modelled_step_time(lengths, budget, fixed, groups, padded):
    parts = partition_padded(lengths, timed_budget(budget, fixed))
    assert len(parts) == groups and padded_tokens(lengths, parts) == padded
    assert step_time_rule(timed_budget(budget, fixed)) == "time"
    assert step_time_rule(replace(timed_budget(budget, fixed), padding_target=None)) == "fewest"
    assert step_time_rule(TokenBudget(budget)) == step_time_rule(budget) == "padding"


def test_the_time_rule_is_optimal_by_brute_force():
    # every partition of the sorted rows into contiguous groups within the budget, from the fewest groups to
    # "samples" mode's count, scored by the model by hand; the cut's modelled seconds are the least of them
    g = random.Random(3)
    for _ in range(60):
        lengths = [g.randint(1, 20) for _ in range(g.randint(1, 7))]
        budget = g.randint(max(lengths), 60)
        st = {"forward_seconds": g.choice([0.0, 3.0, 15.0, 60.0]), "token_seconds": {"1": 1.0, "20": g.choice([1.0, 3.0])}}
        parts = partition_padded(lengths, TokenBudget(budget, step_time=st))

        def seconds(groups, lengths=lengths, st=st):
            total = 0.0
            for gr in groups:
                n = max(lengths[i] for i in gr)
                total += st["forward_seconds"] + len(gr) * n * (1.0 + (st["token_seconds"]["20"] - 1.0) * (n - 1) / 19)
            return total

        fewest = fewest_groups(lengths, budget)
        most = max(fewest, -(-len(lengths) // (budget // max(lengths))))
        assert seconds(parts) == pytest.approx(least_score(lengths, budget, most, seconds))
        assert modelled_seconds(st, lengths, parts) == pytest.approx(seconds(parts))


@settings(max_examples=150, deadline=None)
@given(lengths=st_lists(st_integers(1, 64), min_size=1, max_size=24), spare=st_integers(0, 200),
       fixed=st_floats(0, 1e4), long_cost=st_floats(1, 4), groups=st_integers(0, 30))
def test_every_candidate_cut_is_a_valid_cut_within_the_budget(lengths, spare, fixed, long_cost, groups):
    budget = TokenBudget(max(lengths) + spare, step_time={"forward_seconds": fixed,
                                                          "token_seconds": {"1": 1.0, "64": long_cost}})
    least = fewest_groups(lengths, budget)
    samples = max(least, -(-len(lengths) // (budget.tokens // max(lengths))))
    candidates = candidate_cuts(lengths, budget)
    assert sorted(candidates) == list(range(least, samples + 1))
    chosen = partition_padded(lengths, budget)
    forced = partition_padded(lengths, budget, groups or None)  # ranks agreeing on more forwards
    for count, parts in [*candidates.items(), (len(chosen), chosen), (max(least, min(groups, len(lengths))), forced)]:
        assert sorted(i for gr in parts for i in gr) == list(range(len(lengths)))  # every row once
        assert all(gr and len(gr) * max(lengths[i] for i in gr) <= budget.tokens for gr in parts)
        assert len(parts) == count or parts is forced and len(parts) >= count
    assert candidates[len(chosen)] == chosen  # the choice is one of the candidates, and the cheapest
    assert modelled_seconds(budget.step_time, lengths, chosen) <= min(
        modelled_seconds(budget.step_time, lengths, parts) for parts in candidates.values()) * (1 + 1e-9)


def test_a_stored_plan_keeps_its_step_time_and_one_without_it_cuts_by_the_padding_rule(tmp_path):
    from hf_accum.planning.store import load_plan, save_plan
    from hf_accum.probing.plan import Plan

    st = {"forward_seconds": 50.0, "token_seconds": {"8": 1.0}}
    plan = Plan(5, 1, 1, 5, token_budget=20, step_time=st)
    lengths = [2, 2, 6, 10, 10]
    save_plan(str(tmp_path), {"k": 1}, plan, None)
    again = load_plan(str(tmp_path), {"k": 1})[0]
    assert again == plan and partition_padded(lengths, plan_budget(again)) == partition_padded(lengths, plan_budget(plan))
    assert len(partition_padded(lengths, plan_budget(again))) == 2  # a forward dearer than the padding it saves
    old = replace(plan, step_time=None)  # a plan file stored before step times: the padding rule, 3 forwards
    assert len(partition_padded(lengths, plan_budget(old))) == 3
    with pytest.raises(ValueError, match="step_time"):
        Plan(5, 1, 1, 5, token_budget=20, step_time={"forward_seconds": -1.0, "token_seconds": {"8": 1.0}})
    with pytest.raises(ValueError, match="step_time"):
        Plan(5, 1, 1, 5, step_time=st)  # no token budget




def test_a_plan_without_step_times_says_once_that_the_padding_rule_cuts(tmp_path, caplog):
    args = AccumTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, target_batch_size=8,
        auto_tune=False, micro_batching="tokens", max_tokens_per_forward=120, use_cpu=True, report_to=[],
        remove_unused_columns=False, max_steps=2, save_strategy="no", disable_tqdm=True)
    trainer = AccumTrainer(model=tiny_llama(), args=args, train_dataset=long_tailed(16), data_collator=pad_collate)
    with caplog.at_level(logging.WARNING, logger="hf_accum"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "by the padding rule" in r.getMessage()]
    assert len(said) == 1 and "auto_tune=False: nothing was timed" in said[0]
    assert trainer.plan.step_time is None
