"""The loss kernel and the token budget chosen together (micro_batching="tokens", issue 57 item 2): each kernel's
budget cuts the user's windows as training would and its step-time model prices the whole step; the least wins.
Pure tables and one property; the trainer's record of it is checked in test_token_budget.py's tuner tests."""

import pytest
from hypothesis import given, settings
from hypothesis.strategies import floats as st_floats
from hypothesis.strategies import integers as st_integers
from hypothesis.strategies import lists as st_lists

from hf_accum.levers.kernels import lever
from hf_accum.probing.plan import Plan
from hf_accum.window.kernel_budget import choose_kernel, cut_figures, data_windows
from hf_accum.window.token_budget import TokenBudget, modelled_seconds, partition_padded, plan_budget


def budget(tokens, fixed=None, per_token=1e-3):
    st = None if fixed is None else {"forward_seconds": fixed, "token_seconds": {"100": per_token}}
    return TokenBudget(tokens, step_time=st)


FOUR = [[100, 100, 100, 100]]  # one window of four rows of 100 tokens


@pytest.mark.parametrize("fixed, kernel, seconds", [
    # "fast": 1.0 ms a token, but its memory holds 2 rows a forward (2 forwards); "lean": 1.5 ms, 4 rows (1 forward)
    (1.0, "lean", {"fast": 2 * 1.0 + 0.4, "lean": 1.0 + 0.6}),  # a dear forward: the kernel with fewer forwards
    (0.1, "fast", {"fast": 2 * 0.1 + 0.4, "lean": 0.1 + 0.6}),  # a cheap forward: the faster kernel per token
    (0.2, "fast", {"fast": 2 * 0.2 + 0.4, "lean": 0.2 + 0.6}),  # a tie (0.8 s each): the earlier in the order
])
def test_the_kernel_whose_whole_step_models_least_wins(fixed, kernel, seconds):
    budgets = {"fast": budget(200, fixed, 1e-3), "lean": budget(400, fixed, 1.5e-3)}
    record = choose_kernel(budgets, FOUR, order=["fast", "lean"])
    assert record["kernel"] == kernel and record["by"] == "step time" and record["micro_batching"] == "tokens"
    assert record["step_seconds"] == pytest.approx(seconds)
    assert record["forwards_per_step"] == {"fast": 2, "lean": 1}
    assert record["tokens_per_forward"] == {"fast": 200, "lean": 400}
    assert record["padded_over_real"] == {"fast": 1.0, "lean": 1.0}


def test_a_tie_goes_to_the_earlier_kernel_in_order_whatever_the_dicts_order():
    same = budget(200, 0.5)
    assert choose_kernel({"b": same, "a": same}, FOUR, order=["a", "b"])["kernel"] == "a"
    assert choose_kernel({"a": same, "b": same}, FOUR, order=["b", "a"])["kernel"] == "b"
    # 0.8 s each by the model (0.4 + 0.4 against 0.2 + 0.6, apart by float rounding only): the order decides
    tie = {"fast": budget(200, 0.2, 1e-3), "lean": budget(400, 0.2, 1.5e-3)}
    assert choose_kernel(tie, FOUR, order=["lean", "fast"])["kernel"] == "lean"


def test_without_step_time_models_the_fewest_forwards_win_and_a_timed_kernel_beats_an_untimed_one():
    untimed = {"small": budget(100), "large": budget(400), "larger": budget(800)}
    record = choose_kernel(untimed, FOUR, order=["small", "large", "larger"])
    # large and larger both take 1 forward: the more tokens per forward, then the order
    assert (record["kernel"], record["by"]) == ("larger", "forwards (no step-time model)")
    assert record["step_seconds"] == {} and record["forwards_per_step"] == {"small": 4, "large": 1, "larger": 1}
    # a kernel that timed no model cannot be compared by time: one that did is chosen, even with more forwards
    record = choose_kernel({"untimed": budget(400), "timed": budget(100, 5.0)}, FOUR, order=["untimed", "timed"])
    assert (record["kernel"], record["by"]) == ("timed", "step time") and list(record["step_seconds"]) == ["timed"]
    with pytest.raises(ValueError, match="no kernel"):
        choose_kernel({}, FOUR)


def test_ranks_agree_on_one_kernel_by_the_slowest_ranks_figures():
    # rank 0 alone would take "fast" (a cheap forward), rank 1 "lean" (a dear one: its own cost model, its windows)
    ranks = [({"fast": budget(200, 0.1, 1e-3), "lean": budget(400, 0.1, 1.5e-3)}, FOUR),
             ({"fast": budget(200, 1.0, 1e-3), "lean": budget(400, 1.0, 1.5e-3)}, [[100, 100, 100]])]
    alone = [choose_kernel(b, w) for b, w in ranks]
    assert [r["kernel"] for r in alone] == ["fast", "lean"]
    sent = []  # what each rank hands the collective; MAX over ranks is what each gets back
    for b, w in ranks:
        choose_kernel(b, w, max_of=lambda flat: sent.append(flat) or flat)
    records = [choose_kernel(b, w, max_of=lambda flat: tuple(map(max, *sent))) for b, w in ranks]
    assert records[0] == records[1]  # one kernel, one record on every rank
    for name in ("fast", "lean"):  # the slowest rank's step sets the pace
        assert records[0]["step_seconds"][name] == max(r["step_seconds"][name] for r in alone)
    assert records[0]["kernel"] == "lean"  # fast 2.3 s, lean 1.45 s: rank 1's, slower than rank 0's 0.6 and 0.7
    # a kernel modelled on one rank only counts as modelled on all
    untimed = [({"a": budget(400), "b": budget(100)}, FOUR), ({"a": budget(400, 1.0), "b": budget(100)}, FOUR)]
    sent.clear()
    for b, w in untimed:
        choose_kernel(b, w, max_of=lambda flat: sent.append(flat) or flat)
    assert all(choose_kernel(b, w, max_of=lambda flat: tuple(map(max, *sent)))["by"] == "step time" for b, w in untimed)


def test_data_windows_are_one_fixed_shuffle_of_every_length():
    lengths = list(range(1, 24))
    windows = data_windows(lengths, 5)
    assert windows == data_windows(lengths, 5)  # the same every call: a plan compares the same windows
    assert [len(w) for w in windows] == [5, 5, 5, 5, 3]
    assert sorted(x for w in windows for x in w) == lengths and windows[0] != lengths[:5]


def test_the_record_is_a_valid_plan_lever_and_says_how_it_chose():
    record = choose_kernel({"fast": budget(200, 1.0), "lean": budget(400, 1.0, 1.5e-3)}, FOUR)
    plan = Plan(4, 1, 1, 4, token_budget=400, step_time=budget(400, 1.0, 1.5e-3).step_time,
                levers={"loss_kernel": record})
    assert plan.levers["loss_kernel"]["kernel"] == "lean"
    assert lever.describe(record) == "loss kernel lean (least modelled step time of 2)"
    assert lever.describe(choose_kernel({"a": budget(100), "b": budget(400)}, FOUR)) == \
        "loss kernel b (fewest forwards of 2)"
    assert lever.figures(record)["hf_accum/loss_kernel_step_seconds/lean"] == record["step_seconds"]["lean"]
    with pytest.raises(ValueError, match="loss_kernel"):
        Plan(4, 1, 1, 4, token_budget=400, levers={"loss_kernel": {**record, "step_seconds": {"lean": -1.0}}})


@settings(max_examples=80, deadline=None)
@given(lengths=st_lists(st_integers(1, 64), min_size=1, max_size=40), per_rank=st_integers(1, 16),
       kernels=st_lists(st_lists(st_floats(0, 1), min_size=3, max_size=3), min_size=1, max_size=4))
def test_the_chosen_kernel_models_the_least_step_over_the_cuts_training_takes(lengths, per_rank, kernels):
    # each kernel: (extra tokens per forward over the longest row, fixed seconds, seconds per token)
    budgets = {f"k{i}": TokenBudget(64 + int(spare * 400), step_time={"forward_seconds": fixed * 10,
                                                                       "token_seconds": {"1": 1e-3 + per_token}})
               for i, (spare, fixed, per_token) in enumerate(kernels)}
    windows = data_windows(lengths, per_rank)
    record = choose_kernel(budgets, windows, order=list(budgets))
    for name, b in budgets.items():  # each figure is what training's cut of each window takes by that model
        cuts = [partition_padded(w, b) for w in windows]
        mean = sum(modelled_seconds(b.step_time, w, c) for w, c in zip(windows, cuts)) / len(windows)
        assert record["step_seconds"][name] == pytest.approx(mean, rel=1e-5, abs=1e-6)
        assert cut_figures(windows, b)["forwards_per_step"] == sum(map(len, cuts)) / len(windows)
    assert record["step_seconds"][record["kernel"]] == min(record["step_seconds"].values())
    # a plan that stores the chosen budget cuts every window the same way again
    chosen = budgets[record["kernel"]]
    plan = Plan(per_rank, 1, 1, per_rank, token_budget=chosen.tokens, step_time=chosen.step_time)
    assert all(partition_padded(w, plan_budget(plan)) == partition_padded(w, chosen) for w in windows)
