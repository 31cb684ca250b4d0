"""GrowBack as a table: when a lowered plan returns to the probed one, and how often a recurring OOM can strike."""

import pytest

from hf_accum.planning.growback import GrowBack
from hf_accum.planning.policy import InForce, OomPolicy, as_plan
from hf_accum.probing.plan import Plan


def simulate(after: int, steps: int, oom_at) -> tuple[list[int], list[int]]:
    """Steps 1..steps; ``oom_at(step, lowered)``: whether that step's window runs out of memory. Returns the steps
    that saw an OOM and the steps after which the plan grew back."""
    grow, ooms, grown = GrowBack(after), [], []
    for step in range(1, steps + 1):
        if oom_at(step, grow.lowered):
            grow.oom()
            ooms.append(step)
        elif grow.clean_step():
            grown.append(step)
    return ooms, grown


def test_one_transient_oom_is_back_on_the_probed_plan_within_after_steps():
    ooms, grown = simulate(16, 40, lambda step, lowered: step == 3)
    assert ooms == [3] and grown == [19]


def test_a_recurring_oom_doubles_the_wait():
    # every window at the probed plan runs out of memory from step 3 on (a lowered plan fits)
    ooms, grown = simulate(16, 40, lambda step, lowered: step >= 3 and not lowered)
    assert ooms == [3, 20] and grown == [19]
    ooms, _ = simulate(16, 1000, lambda step, lowered: step >= 3 and not lowered)
    assert len(ooms) <= 7  # 3, 20, 53, 118, 247, 504, 1017: log2 of the run, not steps / 16


@pytest.mark.parametrize("after, steps, expected", [(0, 100, []), (1, 7, [4, 7]), (4, 12, [7])])
def test_table(after, steps, expected):
    _, grown = simulate(after, steps, lambda step, lowered: step == 3 or (step == 5 and after == 1))
    assert grown == expected


def test_no_lowered_plan_nothing_to_grow_back_and_negative_refused():
    grow = GrowBack(16)
    assert not any(grow.clean_step() for _ in range(100)) and grow.clean == 0
    with pytest.raises(ValueError, match="grow_back_steps=-1"):
        GrowBack(-1)


PROBED = Plan(8, 1, 1, 8, levers={"checkpointing": {"layers": 1, "of": 2}})
LOWERED = Plan(4, 2, 1, 8, levers={"checkpointing": {"layers": 1, "of": 2}})


@pytest.mark.parametrize("now, before, expected", [
    (LOWERED, PROBED, PROBED),  # a tuned plan: back to it
    (PROBED, PROBED, None),  # nothing to grow back
    (Plan(4, 2, 1, 8, eval_batch_size=16), PROBED,  # an eval batch measured since the OOM is kept
     Plan(8, 1, 1, 8, levers={"checkpointing": {"layers": 1, "of": 2}}, eval_batch_size=16)),
    (Plan(2, 4, 1, 8), Plan(4, 2, 1, 8), Plan(4, 2, 1, 8)),  # the user's micro-batches
    (Plan(16, 1, 1, 16, token_budget=72), Plan(16, 1, 1, 16, token_budget=96), Plan(16, 1, 1, 16, token_budget=96)),
])
def test_larger_returns_the_plan_before_the_oom(now, before, expected):
    assert OomPolicy().larger(InForce(now, None, 1, True, 8, 8), before) == expected


@pytest.mark.parametrize("plan, micro, world, target, expected", [
    (None, 4, 1, 8, Plan(4, 2, 1, 8)),  # auto_tune off: the micro-batches as loaded
    (None, 2, 2, 16, Plan(2, 4, 2, 16)),
    (PROBED, 8, 1, 8, PROBED),
])
def test_the_plan_in_force_as_a_plan(plan, micro, world, target, expected):
    assert as_plan(InForce(plan, None, world, plan is not None, micro, target)) == expected
