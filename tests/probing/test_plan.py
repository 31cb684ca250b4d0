"""plan.py: the exact plan, the memory line, and the search policy, with exact tables and properties."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hf_accum.probing.plan import (
    Plan,
    choose_fastest,
    divisors,
    fit_memory_model,
    forward_breakpoints,
    nearest_exact_targets,
    plan_batch,
    predict_max_micro,
)
from hf_accum.probing.search import GOAL_FRACTION, MicroBatchSearch
from hf_accum.window.cuts import forwards_for, near_equal_sizes

MiB = 1 << 20


def drive(memory, budget, max_micro, *, must=(), baseline=0, rounding=0, report_over=False, seed=None):
    """Run the search against a formula.  Over budget is an OOM (no value) unless ``report_over``, which
    plays a CPU meter: the step runs and reports how far over it went. ``seed``: where the search starts."""
    search = MicroBatchSearch(budget, max_micro, must_resolve=must, seed=seed)
    tried = []
    while (micro := search.propose()) is not None:
        assert micro not in tried, f"{micro} proposed twice: {tried}"
        assert 1 <= micro <= max_micro
        tried.append(micro)
        value = memory(micro)
        charged = value if (value <= budget or report_over) else None
        search.record(micro, charged, baseline_bytes=baseline, rounding_bytes=rounding)
        assert len(tried) <= 64, f"search does not terminate: {tried}"
    return tried, search


def true_max(memory, budget, max_micro):
    return max((m for m in range(1, max_micro + 1) if memory(m) <= budget), default=0)


def linear(a, b):
    return lambda m: a + b * m


def plateau(c, a, b):  # the optimizer step's fixed peak c dominates small micro-batches
    return lambda m: max(c, a + b * m)


def staircase(a, b, step):  # reserved memory grows in whole allocator segments
    return lambda m: a + (b * m // step + 1) * step


# --- arithmetic ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, expected",
    [
        (1, [1]),
        (2, [1, 2]),
        (12, [1, 2, 3, 4, 6, 12]),
        (16, [1, 2, 4, 8, 16]),
        (37, [1, 37]),
        (36, [1, 2, 3, 4, 6, 9, 12, 18, 36]),
    ],
)
def test_divisors(n, expected):
    assert divisors(n) == expected


@pytest.mark.parametrize("bad", [0, -4, 2.5])
def test_divisors_rejects_non_positive_integers(bad):
    with pytest.raises(ValueError):
        divisors(bad)


@pytest.mark.parametrize("target, world, expected", [(10, 4, (8, 12)), (12, 4, (12,)), (3, 4, (4,)), (7, 2, (6, 8))])
def test_nearest_exact_targets(target, world, expected):
    assert nearest_exact_targets(target, world) == expected


# --- the plan -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target, world, max_micro, micro, accum",
    [
        (64, 1, 64, 64, 1),  # everything fits: no accumulation
        (64, 1, 32, 32, 2),
        (64, 2, 16, 16, 2),  # per-rank target 32
        (64, 4, 4, 4, 4),
        (48, 1, 24, 24, 2),
        (36, 3, 100, 12, 1),  # the per-rank target caps the micro-batch
        (1, 1, 1, 1, 1),
    ],
)
def test_plan_batch_table_even(target, world, max_micro, micro, accum):
    plan = plan_batch(target, world, max_micro)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.world_size) == (micro, accum, world)
    assert plan.micro_batch_size * plan.gradient_accumulation_steps * plan.world_size == target
    assert plan.describe() == f"micro {micro} × accumulation {accum} × world {world} = {target}"


@pytest.mark.parametrize(
    "target, world, max_micro, micro, forwards, line",
    [
        (31, 1, 7, 7, 5, "window 31 × world 1 = 31, 5 forwards of ≤ 7 rows"),  # 7+6+6+6+6, not 31 forwards of 1
        (37, 1, 36, 19, 2, "window 37 × world 1 = 37, 2 forwards of ≤ 19 rows"),  # a prime target: 2 forwards
        (64, 1, 30, 22, 3, "window 64 × world 1 = 64, 3 forwards of ≤ 22 rows"),  # 3 forwards where 30 fit
        (64, 2, 30, 16, 2, "micro 16 × accumulation 2 × world 2 = 64"),  # 30 fit; 2 forwards need only 16
        (64, 4, 5, 4, 4, "micro 4 × accumulation 4 × world 4 = 64"),  # 5 fit; 4 forwards need only 4
        (48, 1, 30, 24, 2, "micro 24 × accumulation 2 × world 1 = 48"),
    ],
)
def test_plan_batch_cuts_any_target_into_the_fewest_forwards(target, world, max_micro, micro, forwards, line):
    plan = plan_batch(target, world, max_micro)
    assert (plan.micro_batch_size, plan.forwards) == (micro, forwards)
    assert plan.forwards == math.ceil(target / world / max_micro)
    assert plan.describe() == line


def test_plan_batch_not_divisible_names_the_argument_and_the_nearest_targets():
    with pytest.raises(ValueError, match=r"target_batch_size=10 is not divisible by world_size=4.*8 or 12"):
        plan_batch(10, 4, 8)


def test_plan_batch_nothing_fits_says_what_would_help():
    with pytest.raises(ValueError, match=r"no micro-batch fits.*gradient_checkpointing.*LoRA.*4-bit"):
        plan_batch(64, 1, 0)


@pytest.mark.parametrize("target, world", [(0, 1), (8, 0), (-8, 2), (8.0, 1), (True, 1)])
def test_plan_batch_rejects_bad_numbers(target, world):
    with pytest.raises(ValueError, match="must be a positive integer"):
        plan_batch(target, world, 4)


@pytest.mark.parametrize("micro, accumulation, world, target", [
    (3, 2, 1, 8),  # 2 forwards of 3 cannot hold 8 samples
    (2, 5, 1, 8),  # 4 forwards of 2 are enough: 5 is not the fewest
    (9, 1, 1, 8),  # a forward larger than the window
    (2, 2, 3, 8),  # the world does not divide the target
])
def test_a_plan_that_does_not_cut_its_window_cannot_be_built(micro, accumulation, world, target):
    with pytest.raises(ValueError, match="inconsistent plan"):
        Plan(micro_batch_size=micro, gradient_accumulation_steps=accumulation, world_size=world,
             target_batch_size=target)


@pytest.mark.parametrize("units, forwards, sizes", [
    (31, 5, [6, 6, 6, 6, 7]), (32, 4, [8, 8, 8, 8]), (7, 3, [2, 2, 3]), (3, 5, [1, 1, 1]), (1, 1, [1]),
])
def test_near_equal_sizes(units, forwards, sizes):
    assert near_equal_sizes(units, forwards) == sizes


@given(per_rank=st.integers(1, 600))
def test_forward_breakpoints_are_the_smallest_size_for_each_forward_count(per_rank):
    points = forward_breakpoints(per_rank)
    counts = [forwards_for(per_rank, m) for m in points]
    assert counts == sorted(set(counts), reverse=True)  # one breakpoint per forward count, strictly fewer
    for m in range(1, per_rank + 1):  # any size does the work of the largest breakpoint not above it
        below = max(p for p in points if p <= m)
        assert forwards_for(per_rank, m) == forwards_for(per_rank, below)


@given(
    world=st.integers(1, 16),
    per_rank=st.integers(1, 512),
    max_micro=st.integers(1, 1024),
    extra=st.integers(0, 64),
)
def test_plan_batch_properties(world, per_rank, max_micro, extra):
    target = world * per_rank
    plan = plan_batch(target, world, max_micro)
    sizes = near_equal_sizes(per_rank, plan.forwards)
    assert sum(sizes) == per_rank and max(sizes) == plan.micro_batch_size <= max_micro
    # the fewest forwards any cut of the window into forwards of at most max_micro can have
    assert plan.forwards == math.ceil(per_rank / min(max_micro, per_rank))
    # even plans are transformers' micro x accumulation x world = target
    assert plan.even == (plan.micro_batch_size * plan.forwards * world == target)
    # monotone: more memory never gives more forwards
    assert plan_batch(target, world, max_micro + extra).forwards <= plan.forwards


@given(world=st.integers(2, 16), target=st.integers(1, 4096))
def test_plan_batch_refuses_any_target_the_world_does_not_divide(world, target):
    assume(target % world)
    with pytest.raises(ValueError) as info:
        plan_batch(target, world, 8)
    for option in nearest_exact_targets(target, world):
        assert option % world == 0 and str(option) in str(info.value)


@pytest.mark.parametrize(
    "rates, per_rank, max_micro, expected",
    [
        ({1: 10.0, 2: 19.0, 4: 30.0, 8: 29.0}, 16, 8, 4),  # fastest, not largest
        ({1: 10.0, 2: 30.0, 4: 30.0}, 16, 8, 4),  # a tie goes to the larger micro-batch
        ({1: 10.0, 2: 19.0, 4: 30.0, 8: 99.0}, 16, 6, 4),  # 8 does not fit
        ({1: 10.0, 3: 50.0, 4: 30.0}, 16, 8, 3),  # 6 forwards of 3 (0.36 s) beat 4 of 4 (0.53 s)
        ({1: 10.0, 6: 60.0, 7: 62.0}, 31, 7, 7),  # 5 forwards of 7 (0.56 s) beat 6 of 6 (0.6 s)
        ({1: 10.0, 5: 30.0, 6: 30.0}, 12, 6, 6),  # 5 takes 3 forwards, as many as 4: 6 needs 2
    ],
)
def test_choose_fastest(rates, per_rank, max_micro, expected):
    assert choose_fastest(rates, per_rank, max_micro) == expected


# --- the memory line ----------------------------------------------------------------------------------
def test_fit_uses_the_largest_points_so_the_bend_at_small_micro_batches_is_ignored():
    curve = plateau(300, 100, 10)  # flat at 300 up to micro 20, then 100 + 10·m
    points = [(m, curve(m)) for m in (1, 2, 25, 30)]
    a, b = fit_memory_model(points, tail=2)
    assert (a, b) == pytest.approx((100, 10))
    a_all, b_all = fit_memory_model(points, tail=4)
    assert b_all < 10  # through the bend the slope is too small: it would over-predict what fits


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="two or more"):
        fit_memory_model([(4, 100.0), (4, 120.0)])


@pytest.mark.parametrize(
    "model, budget, expected",
    [
        ((100, 10), 400, 30),
        ((100, 10), 399, 29),
        ((100.0, 0.1), 100.3, 3),
        ((100, 0), 400, None),
        ((500, 10), 400, -10),
    ],
)
def test_predict_max_micro(model, budget, expected):
    assert predict_max_micro(model, budget) == expected


# --- the search: exact sizes tried ---------------------------------------------------------------------
# fmt: off
SEARCH_TABLE = [
    # id, memory, budget, max micro, must resolve, baseline, rounding, sizes tried, found
    # linear from 1: 1, the provable-fit jump (400 / 110 -> 3), then the line's prediction, exact
    ("linear", linear(100 * MiB, 10 * MiB), 400 * MiB, 1024, (), 0, 0, [1, 3, 30], 30),
    # a known baseline (weights + optimizer state) makes the provable jump much longer
    ("linear-baseline", linear(100 * MiB, 10 * MiB), 400 * MiB, 1024, (), 90 * MiB, 0, [1, 15, 30], 30),
    # the cap (the per-rank target) is reached: verified once, done
    ("capped", linear(100 * MiB, 10 * MiB), 777 * MiB, 64, divisors(64), 0, 0, [1, 7, 64], 64),
    # a 25 MiB rounding margin aims the jump at 487 (< 490 predicted): one trial, within the goal
    ("margin", linear(100 * MiB, 10 * MiB), 5000 * MiB, 1024, (), 0, 25 * MiB, [1, 45, 487], 487),
    # with a small prediction the margin would land under the goal (29 < 0.95 * 30), so 29 is tried
    ("margin-small", linear(100 * MiB, 10 * MiB), 400 * MiB, 1024, (), 0, 25 * MiB, [1, 3, 29], 29),
    # ... unless 30 divides the target: the plan can use it, so it must be resolved, and it is tried
    ("margin-divisor", linear(100 * MiB, 10 * MiB), 400 * MiB, 60, divisors(60), 0, 25 * MiB, [1, 3, 30], 30),
    # nothing fits at 1: one trial, nothing found
    ("nothing-fits", linear(300 * MiB, 200 * MiB), 400 * MiB, 64, divisors(64), 0, 0, [1], 0),
    # 1 fits exactly at the budget, and the line says 2 does not
    ("only-one", linear(200 * MiB, 200 * MiB), 400 * MiB, 64, divisors(64), 0, 0, [1, 2], 1),
    # the optimizer-step plateau: flat lines double, the jump across the bend fails, bisection recovers
    ("plateau", plateau(300 * MiB, 100 * MiB, 10 * MiB), 400 * MiB, 64, divisors(64), 90 * MiB, 0,
     [1, 2, 4, 8, 16, 32, 24, 28, 30], 30),
    # a short plateau (the optimizer step's peak only dominates micro 1): the secant through it is too
    # flat, 97 runs out of memory, the bisection point 59 gives an exact line, and the margin learnt from
    # 59's misprediction aims at 89 of the 90 that fit
    ("short-plateau", plateau(130 * MiB, 100 * MiB, 10 * MiB), 1000 * MiB, 1024, (), 90 * MiB, 0,
     [1, 22, 97, 59, 89], 89),
    # memory growing faster than linear: the jump out of memory, geometric bisection, refit
    ("convex", lambda m: 100 * MiB + 10 * MiB * m + MiB * m * m // 10, 400 * MiB, 1024, (), 0, 0,
     [1, 3, 28, 15, 25, 20, 23], 23),
    # reserved memory in 20 MiB segments: the line through two steps overshoots once
    ("staircase", staircase(100 * MiB, 10 * MiB, 20 * MiB), 777 * MiB, 1024, (), 0, 0, [1, 6, 55, 66, 60, 63], 63),
]
# fmt: on


@pytest.mark.parametrize(
    "memory, budget, max_micro, must, baseline, rounding, expected_tried, expected_found",
    [row[1:] for row in SEARCH_TABLE],
    ids=[row[0] for row in SEARCH_TABLE],
)
def test_search_tries_exactly(memory, budget, max_micro, must, baseline, rounding, expected_tried, expected_found):
    tried, search = drive(memory, budget, max_micro, must=must, baseline=baseline, rounding=rounding)
    assert tried == expected_tried
    assert search.largest_fit == expected_found
    best = true_max(memory, budget, max_micro)
    assert expected_found <= best
    assert expected_found >= GOAL_FRACTION * best


def test_a_cpu_meter_reports_over_budget_values_and_the_line_interpolates_across_the_budget():
    # the same convex curve, but over-budget steps report their memory (CPU: no OOM, just a number)
    memory = lambda m: 100 * MiB + 10 * MiB * m + MiB * m * m // 10  # noqa: E731
    tried, search = drive(memory, 400 * MiB, 1024, report_over=True)
    assert tried == [1, 3, 28, 25, 24]  # 5 trials instead of 7 for the same curve with out-of-memory errors
    assert search.largest_fit == 24 == true_max(memory, 400 * MiB, 1024)


@pytest.mark.parametrize(
    "memory, budget, max_micro, must, expected",
    [
        (linear(100, 10), 400, 1024, (), (31, "predicted")),  # found 30; the line puts 31 over
        (linear(100, 10), 400, 96, divisors(96), (32, "predicted")),  # the next divisor of 96 after 30
        (linear(100, 10), 777, 64, divisors(64), (None, "cap")),  # 64 fits: nothing left
        # without sizes to resolve, the search may stop within the goal below a size that fits: 63 of 65
        (staircase(100 * MiB, 10 * MiB, 20 * MiB), 777 * MiB, 1024, (), (64, "untried")),
        # with them it may not: 64 divides 128, so it is tried (and fits); 128 is over because 66 was
        (staircase(100 * MiB, 10 * MiB, 20 * MiB), 777 * MiB, 1024, divisors(128), (128, "measured")),
        (lambda m: 100 + 10 * m + m * m // 10, 400, 64, divisors(64), (32, "measured")),  # 28 ran out of memory
    ],
)
def test_next_over_says_how_the_next_size_is_known_not_to_fit(memory, budget, max_micro, must, expected):
    _, search = drive(memory, budget, max_micro, must=must)
    size, verdict = search.next_over()
    assert (size, verdict) == expected
    if verdict == "measured":
        assert memory(size) > budget
    elif verdict == "predicted":
        assert search.predict(size) > budget


def test_margin_is_the_worst_observed_deviation_or_the_rounding():
    search = MicroBatchSearch(1000, 100)
    search.record(1, 110.0, rounding_bytes=3)
    assert search.margin_bytes() == 3
    search.record(search.propose(), 200.0, rounding_bytes=3)  # provable jump: no prediction to compare
    proposal = search.propose()
    predicted = search.predict(proposal)
    search.record(proposal, predicted + 40)  # the line under-estimated this point by 40 bytes
    assert search.margin_bytes() == pytest.approx(40)


@pytest.mark.parametrize("budget, max_micro", [(0, 4), (-1, 4), (100, 0)])
def test_search_rejects_bad_settings(budget, max_micro):
    with pytest.raises(ValueError):
        MicroBatchSearch(budget, max_micro)


# --- the search: properties ---------------------------------------------------------------------------------
sizes = st.integers(1, 4096)


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, 10**10), b=st.integers(1, 10**9), headroom=st.integers(0, 10**12), max_micro=sizes)
def test_linear_memory_gives_the_exact_plan_in_at_most_three_trials(a, b, headroom, max_micro):
    memory, budget = linear(a, b), a + b + headroom  # micro 1 always fits
    best = true_max(memory, budget, max_micro)
    tried, search = drive(memory, budget, max_micro)
    assert GOAL_FRACTION * best <= search.largest_fit <= best
    assert len(tried) <= 3
    # with the sizes a plan can use to resolve, the plan is the one the true maximum gives
    target = max_micro
    tried, search = drive(memory, budget, max_micro, must=forward_breakpoints(target))
    assert plan_batch(target, 1, search.largest_fit) == plan_batch(target, 1, best)
    assert len(tried) <= 4


@settings(max_examples=100, deadline=None)
@given(a=st.integers(0, 10**9), b=st.integers(1, 10**8), budget=st.integers(1, 10**11), more=st.integers(1, 10**10))
def test_found_maximum_is_monotone_in_the_budget(a, b, budget, more):
    small = drive(linear(a, b), budget, 512)[1].largest_fit
    large = drive(linear(a, b), budget + more, 512)[1].largest_fit
    assert large >= small


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["plateau", "staircase", "convex"]),
    a=st.integers(10**6, 10**9),
    b=st.integers(10**4, 10**8),
    knee=st.integers(1, 40),
    budget_factor=st.floats(1.0, 400.0),
    max_micro=sizes,
    target=st.integers(1, 512),
    report_over=st.booleans(),
)
def test_any_curve_ends_with_a_fitting_size_within_the_goal(
    kind, a, b, knee, budget_factor, max_micro, target, report_over
):
    memory = {
        "plateau": plateau(a + b * knee, a, b),
        "staircase": staircase(a, b, 20 * MiB),
        "convex": lambda m: a + b * m + (b * m * m) // (10 * knee),
    }[kind]
    budget = int(memory(1) * budget_factor)
    must = forward_breakpoints(target)
    tried, search = drive(memory, budget, max_micro, must=must, report_over=report_over)
    best = true_max(memory, budget, max_micro)
    found = search.largest_fit
    assert memory(found) <= budget if found else best == 0
    assert found >= math.floor(GOAL_FRACTION * best)
    # the plan from the found maximum is the one the true maximum gives, unless the next divisor was
    # predicted over and the prediction was wrong; the verdict is reported so the caller can say so
    size, verdict = search.next_over()
    if verdict == "measured":
        assert memory(size) > budget
    assert len(tried) <= 2 * math.log2(max_micro + 1) + 6


@pytest.mark.xfail(strict=True, reason="known defect, found by the property test above with a random draw: on a "
                   "20 MiB staircase whose every size up to the cap fits, the search stops at 46 of 50 (0.92 < 0.95)")
def test_known_staircase_case_misses_the_goal():
    memory = staircase(1_000_000, 911_806, 20 * MiB)
    budget = int(memory(1) * 3.0)
    tried, search = drive(memory, budget, 50, must=divisors(1), report_over=False)
    assert search.largest_fit >= math.floor(GOAL_FRACTION * true_max(memory, budget, 50))


@pytest.mark.parametrize("shape", ["linear", "intercept", "plateau", "staircase", "convex"])
def test_the_goals_hold_on_average_over_a_family_of_curves(shape):
    """The issue's goals on 100 seeded random curves per shape: <= 4 measured trials on average and a found
    maximum >= 0.95 of the true one (in fact the same plan)."""
    rng = random.Random(shape)
    trials = []
    for _ in range(100):
        base, per_sample = rng.uniform(100, 2000) * MiB, rng.uniform(1, 50) * MiB
        extra, knee = rng.uniform(0.5, 20) * per_sample, rng.randint(2, 12)
        memory = {
            "linear": lambda m, b=base, s=per_sample: b + s * m,
            "intercept": lambda m, b=base, s=per_sample, c=extra: b + c + s * m,
            "plateau": lambda m, b=base, s=per_sample, k=knee: b + s * max(m, k),
            "staircase": lambda m, b=base, s=per_sample: b + (s * m // (20 * MiB) + 1) * 20 * MiB,
            "convex": lambda m, b=base, s=per_sample: b + s * m + 0.02 * s * m * m,
        }[shape]
        budget = memory(1) * rng.uniform(1.2, 20)
        target = rng.choice([16, 32, 48, 64, 96, 128, 256])
        rounding = 20 * MiB if shape in ("intercept", "staircase") else 0
        tried, search = drive(memory, budget, target, must=forward_breakpoints(target), baseline=base,
                              rounding=rounding)
        best = true_max(memory, budget, target)
        assert search.largest_fit >= math.floor(GOAL_FRACTION * best)
        # and the plan is the one the true maximum gives: every usable size up to the estimate was resolved
        assert plan_batch(target, 1, search.largest_fit) == plan_batch(target, 1, best)
        trials.append(len(tried))
    assert sum(trials) / len(trials) <= 4


# --- the one divisibility check (plan_batch, the probe, the arguments, restoring a plan use it) -------------------
@pytest.mark.parametrize("target, world, names, expected", [
    (8, 4, (), None),
    (12, 1, (), None),
    (10, 4, (), "target_batch_size=10 is not divisible by world_size=4: micro x accumulation x world must equal it "
                "exactly. Set target_batch_size to 8 or 12"),
    (3, 4, ("--target-batch", "--world-size"), "--target-batch=3 is not divisible by --world-size=4: micro x "
                                               "accumulation x world must equal it exactly. use --target-batch 4"),
])
def test_indivisible_target(target, world, names, expected):
    from hf_accum.probing.plan import indivisible_target

    assert indivisible_target(target, world, *names) == expected
