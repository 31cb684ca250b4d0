"""The step-time model a token budget's window is cut by (hf_accum/window/step_time.py): fitted from the probe's timed
steps, read between them, and the cut it makes, scored by hand."""

import random
from dataclasses import replace

import pytest

from hf_accum.probing.plan import Plan
from hf_accum.window.step_time import Forwards, check, fit_step_time, packed_seconds
from hf_accum.window.token_budget import (
    TokenBudget,
    candidate_cuts,
    fewest_groups,
    modelled_seconds,
    partition_padded,
    plan_budget,
    step_time_rule,
    token_seconds,
)
from tests.window.by_hand import least_score


def sized(optimizer=0.0, **lengths):
    """A sized model: ``sized(0.1, L64={1: 0.5, 2: 0.6})``."""
    return {"optimizer_seconds": optimizer,
            "forward_seconds_by_rows": {k[1:]: {str(r): s for r, s in v.items()} for k, v in lengths.items()}}


def test_a_forward_costs_its_step_less_the_optimizers_median_never_less_with_more_rows():
    timed = {64: {1: 0.30, 2: 0.32, 4: 0.36, 8: 0.44}, 512: {1: 0.5, 2: 0.7}}
    st = fit_step_time(timed, [0.2, 0.9, 0.25])  # the median, 0.25: one probe's hiccup is not the optimizer's cost
    assert st["optimizer_seconds"] == 0.25
    assert st["forward_seconds_by_rows"] == {
        "64": {"1": pytest.approx(0.05), "2": pytest.approx(0.07), "4": pytest.approx(0.11), "8": pytest.approx(0.19)},
        "512": {"1": pytest.approx(0.25), "2": pytest.approx(0.45)}}
    # more rows measured faster is noise: raised to the smaller size's; below the optimizer's alone: 0
    st = fit_step_time({64: {1: 0.30, 2: 0.28, 4: 0.40}, 128: {1: 0.1, 2: 0.5}}, [0.2])
    assert st["forward_seconds_by_rows"]["64"] == {"1": pytest.approx(0.1), "2": pytest.approx(0.1),
                                                   "4": pytest.approx(0.2)}
    assert st["forward_seconds_by_rows"]["128"] == {"1": 0.0, "2": pytest.approx(0.3)}
    # no optimizer timed: every forward carries it (0 subtracted); an out-of-memory step (0 s) is left out
    assert fit_step_time({64: {1: 0.3, 2: 0.0, 4: 0.5}})["forward_seconds_by_rows"] == {"64": {"1": 0.3, "4": 0.5}}


@pytest.mark.parametrize("timed, optimizer", [
    ({512: {4: 1.0}}, [0.1]),  # one size only: nothing says how a forward grows with its rows
    ({512: {4: 1.0}, 64: {2: 0.5}}, []),  # one size at each length
    ({64: {1: 0.1, 2: 0.1}}, [0.3]),  # every step below the optimizer's alone: no forward costs anything
    ({}, [0.1]),
])
def test_no_model_without_two_sizes_at_a_length_or_a_forward_that_costs_anything(timed, optimizer):
    assert fit_step_time(timed, optimizer) is None


def test_a_forwards_cost_is_read_between_the_timed_sizes_and_lengths():
    st = sized(0.5, L64={1: 1.0, 2: 1.5, 8: 3.0}, L256={1: 4.0, 2: 6.0}, L32={4: 2.0})
    cost = Forwards(st).cost
    assert Forwards(st).optimizer == 0.5
    assert cost(64, 1) == 1.0 and cost(64, 8) == 3.0 and cost(256, 2) == 6.0  # timed: as timed
    assert cost(64, 4) == pytest.approx(2.0)  # between 2 (1.5) and 8 (3.0) rows: linear
    assert cost(64, 16) == pytest.approx(5.0)  # beyond the largest: the last two sizes' line
    assert cost(32, 2) == pytest.approx(1.0)  # one size timed at 32: proportional to the rows
    # between 64 and 256: a forward of as many tokens at each, linear in the length; 160 x 2 = 320 tokens are
    # 5 rows at 64 (2.25) and 1.25 rows at 256 (4.5)
    assert cost(160, 2) == pytest.approx(0.5 * 2.25 + 0.5 * 4.5)
    assert cost(512, 1) == 6.0  # beyond the longest: as many tokens at 256 (2 rows)
    assert cost(512, 2) == pytest.approx(10.0)  # 4 rows at 256: its two sizes' line extended
    assert cost(16, 2) == pytest.approx(cost(32, 1))  # shorter than the shortest: its cost of as many tokens
    # never below 0 where a line extended below its sizes would go there
    assert Forwards(sized(L8={2: 0.1, 4: 1.0})).cost(8, 1) == 0.0


def test_the_earlier_model_is_still_read_as_a_fixed_cost_plus_a_cost_per_padded_token():
    st = {"forward_seconds": 0.01, "token_seconds": {"64": 1e-5, "512": 3e-5}}
    assert token_seconds(st, 32) == pytest.approx(1e-5) and token_seconds(st, 1000) == pytest.approx(3e-5)
    assert token_seconds(st, 288) == pytest.approx(2e-5)  # linear between the timed lengths
    assert Forwards(st).cost(288, 3) == pytest.approx(0.01 + 3 * 288 * 2e-5)
    assert Forwards(st).optimizer == 0.0
    assert modelled_seconds(st, [10, 288, 20], [[0, 2], [1]]) == pytest.approx(
        2 * 0.01 + 2 * 20 * 1e-5 + 288 * 2e-5)


def test_where_small_forwards_are_cheap_per_token_the_window_takes_more_of_them():
    # one row of 32 (one per forward: "samples" mode's count is 8) and 7 rows of 8 (4 per forward): the fewest is
    # 3 forwards, [32] [8 x 4] [8 x 3]; a forward of 32 tokens costs c4 (4 rows at the timed length 8), of 24 c3
    lengths = [32] + [8] * 7

    def cut(c2):
        budget = TokenBudget(32, step_time=sized(1.0, L8={1: 0.3, 2: c2, 4: 1.0}))
        assert step_time_rule(budget) == "time" and fewest_groups(lengths, budget) == 3
        parts = partition_padded(lengths, budget)
        return sorted(len(g) for g in parts), modelled_seconds(budget.step_time, lengths, parts)

    # c2 = 0.4, c3 = 0.7: 3 forwards 1.0 + 1.0 + 0.7; 4 forwards [32] [2] [2] [3]: 1.0 + 0.4 + 0.4 + 0.7 (5 forwards
    # tie at 2.5: the fewer)
    assert cut(0.4) == ([1, 2, 2, 3], pytest.approx(1.0 + 2.5))
    # c2 = 0.6, c3 = 0.8: 3 forwards 2.8; the best of 4, [32] [1] [2] [4] or [32] [1] [3] [3], 2.9
    assert cut(0.6) == ([1, 3, 4], pytest.approx(1.0 + 2.8))


def test_the_sized_rule_is_optimal_by_brute_force():
    # every partition of the sorted rows into contiguous groups within the budget, from the fewest groups to
    # "samples" mode's count, scored by hand: at each timed length a forward costs a + b x its tokens (so reading
    # between its sizes is exact), and a length between two timed ones the mix of both at as many tokens
    g = random.Random(5)
    for _ in range(60):
        lengths = [g.randint(1, 20) for _ in range(g.randint(1, 7))]
        budget = g.randint(max(lengths), 60)
        a = {4: g.choice([0.0, 3.0, 15.0]), 16: g.choice([0.0, 5.0, 40.0])}
        b = {4: 1.0, 16: g.choice([1.0, 2.0, 4.0])}
        st = sized(g.choice([0.0, 7.0]), **{f"L{n}": {r: a[n] + b[n] * r * n for r in (1, 2, 3)} for n in (4, 16)})
        parts = partition_padded(lengths, TokenBudget(budget, step_time=st))

        def by_hand(groups, lengths=lengths, a=a, b=b, st=st):
            total = st["optimizer_seconds"]
            for gr in groups:
                n = max(lengths[i] for i in gr)
                tokens = len(gr) * n
                w = min(1.0, max(0.0, (n - 4) / 12))
                total += (1 - w) * (a[4] + b[4] * tokens) + w * (a[16] + b[16] * tokens)
            return total

        most = max(fewest_groups(lengths, budget), -(-len(lengths) // (budget // max(lengths))))
        assert by_hand(parts) == pytest.approx(least_score(lengths, budget, most, by_hand))
        assert modelled_seconds(st, lengths, parts) == pytest.approx(by_hand(parts))
        assert parts in candidate_cuts(lengths, TokenBudget(budget, step_time=st)).values()


def test_packed_sequences_of_one_length_cost_what_the_padded_forward_of_them_costs():
    st = sized(0.5, L32={1: 0.1, 4: 0.2, 16: 0.5}, L128={1: 0.3, 4: 0.9})
    for length, rows in ((32, 4), (128, 3), (64, 5)):
        assert packed_seconds(st, [[length] * rows]) == pytest.approx(
            modelled_seconds(st, [length] * rows, [list(range(rows))]))
    # a packed sequence's attention is its own length's: cheaper than padding the short ones to the long one
    assert packed_seconds(st, [[32, 32, 128]]) < modelled_seconds(st, [32, 32, 128], [[0, 1, 2]])
    old = {"forward_seconds": 0.01, "token_seconds": {"8": 1e-3}}
    assert packed_seconds(old, [[8, 8], [16]]) == pytest.approx(2 * 0.01 + 32 * 1e-3)


def test_a_stored_sized_plan_cuts_the_same_windows_again_and_a_wrong_one_is_refused(tmp_path):
    from hf_accum.planning.store import load_plan, save_plan

    st = sized(0.2, L2={1: 0.3, 2: 0.31, 4: 0.5}, L10={1: 0.4, 2: 0.8})
    plan = Plan(5, 1, 1, 5, token_budget=20, step_time=st)
    lengths = [2, 2, 6, 10, 10]
    save_plan(str(tmp_path), {"k": 1}, plan, None)
    again = load_plan(str(tmp_path), {"k": 1})[0]
    assert again == plan and partition_padded(lengths, plan_budget(again)) == partition_padded(lengths, plan_budget(plan))
    assert "forwards timed at each size at lengths 2/10" in plan.describe()
    assert check(st) is None
    for wrong, says in (({**st, "optimizer_seconds": -1.0}, "optimizer_seconds >= 0"),
                        ({**st, "forward_seconds_by_rows": {"2": {"0": 0.1}}}, "forward_seconds_by_rows"),
                        ({**st, "forward_seconds_by_rows": {}}, "forward_seconds_by_rows"),
                        ({"forward_seconds": 0.1}, "token_seconds")):
        with pytest.raises(ValueError, match=says):
            Plan(5, 1, 1, 5, token_budget=20, step_time=wrong)
    with pytest.raises(ValueError, match="needs a token_budget"):
        replace(plan, token_budget=None)
