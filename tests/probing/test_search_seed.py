"""The micro-batch search seeded with an estimate of the largest fit (`MicroBatchSearch(seed=...)`): trials against a
simulated meter (a formula), the answer always the measured one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_accum.probing.plan import forward_breakpoints
from hf_accum.probing.search import MicroBatchSearch
from hf_accum.window.cuts import forwards_for
from tests.probing.test_plan import drive as plan_drive
from tests.probing.test_plan import linear, true_max

MiB = 1 << 20


def drive(memory, budget, max_micro, *, seed=None, must=(), report_over=False):
    """test_plan's search against a formula, started at ``seed``, the baseline read from the formula at 0."""
    return plan_drive(memory, budget, max_micro, must=must, baseline=memory(0), report_over=report_over, seed=seed)



CURVES = [  # (memory, budget, per-rank target): the true largest fit lies inside the window
    (linear(1000 * MiB, 300 * MiB), 4000 * MiB, 32),
    (linear(2000 * MiB, 37 * MiB), 3000 * MiB, 64),
    (lambda m: 500 * MiB + 40 * MiB * m + MiB * m * m, 2500 * MiB, 64),  # convex: attention's seq x seq
    (linear(8000 * MiB, 900 * MiB), 30000 * MiB, 32),
    (lambda m: max(3000 * MiB, 1000 * MiB + 100 * MiB * m), 6000 * MiB, 128),  # the optimizer-step plateau
]


@pytest.mark.parametrize("memory, budget, target", CURVES)
@pytest.mark.parametrize("report_over", [False, True], ids=["cuda", "cpu"])
def test_a_right_estimate_takes_two_trials_where_the_search_takes_more(memory, budget, target, report_over):
    must = forward_breakpoints(target)
    right = true_max(memory, budget, target)
    unseeded, plain = drive(memory, budget, target, must=must, report_over=report_over)
    seeded, search = drive(memory, budget, target, seed=right, must=must, report_over=report_over)
    assert seeded == [right, right + 1]
    assert search.largest_fit == right and search.smallest_failure == right + 1
    assert len(seeded) <= len(unseeded) and plain.largest_fit <= right


@pytest.mark.parametrize("report_over", [False, True], ids=["cuda", "cpu"])
def test_over_the_curves_a_right_estimate_lowers_the_average_trials_to_two(report_over):
    plain, seeded = [], []
    for memory, budget, target in CURVES:
        must = forward_breakpoints(target)
        plain.append(len(drive(memory, budget, target, must=must, report_over=report_over)[0]))
        seeded.append(len(drive(memory, budget, target, seed=true_max(memory, budget, target), must=must,
                                report_over=report_over)[0]))
    assert sum(seeded) / len(seeded) == 2 < sum(plain) / len(plain), (plain, seeded)


@pytest.mark.parametrize("memory, budget, target", CURVES)
@pytest.mark.parametrize("off", [-7, -3, -1, 1, 2, 5, 40, 1000])
@pytest.mark.parametrize("report_over", [False, True], ids=["cuda", "cpu"])
def test_a_wrong_estimate_still_ends_on_a_measured_fit(memory, budget, target, off, report_over):
    must = forward_breakpoints(target)
    right = true_max(memory, budget, target)
    seed = max(1, right + off)
    tried, search = drive(memory, budget, target, seed=seed, must=must, report_over=report_over)
    assert tried[0] == min(seed, target)
    found = search.largest_fit
    assert 1 <= found <= right and memory(found) <= budget  # measured, never taken from the estimate
    # the plan is the one the true largest fit gives: as few forwards (the search resolves every usable size)
    assert forwards_for(target, found) == forwards_for(target, right)
    if abs(off) == 1:  # one off: the size beside it brackets the boundary
        assert len(tried) <= 3 and found == right


def test_a_seed_at_the_cap_that_fits_is_one_trial():
    tried, search = drive(linear(100, 1), 10_000, 16, seed=16)
    assert tried == [16] and search.largest_fit == 16


def test_a_seed_when_nothing_fits_ends_with_nothing():
    tried, search = drive(linear(100, 50), 120, 8, seed=3)
    assert tried == [3, 2, 1] and search.largest_fit == 0


def test_seed_is_clamped_into_the_window():
    assert MicroBatchSearch(1000, 8, seed=99).seed == 8
    assert MicroBatchSearch(1000, 8, seed=0).seed == 1
    assert MicroBatchSearch(1000, 8).propose() == 1


@settings(max_examples=200, deadline=None)
@given(a=st.integers(1, 10_000), b=st.integers(1, 5_000), budget=st.integers(1, 200_000), cap=st.integers(1, 64),
       seed=st.integers(1, 80), report_over=st.booleans())
def test_any_seed_gives_a_fit_that_was_measured_and_an_exact_bracket_when_it_stops_beside_it(
        a, b, budget, cap, seed, report_over):
    memory = linear(a, b)
    tried, search = drive(memory, budget, cap, seed=seed, report_over=report_over)
    right = true_max(memory, budget, cap)
    assert search.largest_fit <= right
    assert search.largest_fit == 0 or search.largest_fit in tried
    assert (search.largest_fit == 0) == (right == 0)
