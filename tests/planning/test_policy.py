"""The planner's OOM policy (planning/policy.py) is pure: what a plan lowers to after an out-of-memory error, as a
table of cases (growing back, `larger`, is tabled in tests/planning/test_growback.py)."""

import pytest

from hf_accum.planning.policy import InForce, OomPolicy
from hf_accum.probing.plan import Plan
from hf_accum.window.token_budget import TokenBudget


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        # windows loaded whole: one forward more per window, near-equal (no divisor needed)
        (InForce(Plan(5, 2, 1, 10), None, 1, True, 10, 10), (4, 3)),
        (InForce(Plan(5, 2, 1, 10), 3, 1, True, 10, 10), (2, 5)),  # from the engine's cut in force
        (InForce(Plan(1, 10, 1, 10), None, 1, True, 10, 10), None),  # nothing below 1
        # micro-batches loaded as given: the same rule on each loaded micro-batch (one forward more, near-equal)
        (InForce(None, None, 2, False, 4, 16), (2, 4)),
        (InForce(None, 2, 2, False, 4, 16), (1, 8)),
        (InForce(None, None, 1, False, 1, 8), None),
        (InForce(None, None, 1, False, 5, 10), (3, 4)),  # 5 -> 3 + 2, not 2 + 2 + 1 (the divisor 2 of 10)
        (InForce(None, None, 1, False, 6, 12), (3, 4)),  # 6 -> 3 + 3, not 4 + 2 (the divisor 4 of 12)
        (InForce(None, 3, 1, False, 6, 12), (2, 6)),
    ],
)
def test_smaller(now, expected):
    plan = OomPolicy().smaller(now)
    assert (None if plan is None else (plan.micro_batch_size, plan.gradient_accumulation_steps)) == expected
    if plan is not None:
        assert plan.target_batch_size == now.target and plan.world_size == now.world  # the target is kept


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("loaded", [1, 2, 3, 5, 6, 7, 10, 12, 16, 31])
def test_smaller_is_the_near_equal_cut_with_the_fewest_forwards_per_loaded_batch(whole, loaded):
    """Both loading modes, each step down from the loaded size to 1: every cut needs the fewest forwards per loaded
    batch of all cuts below the last, and is their near-equal size (the smallest cut giving that count; the engine
    cuts near-equal anyway), checked against all cuts by brute force."""
    policy, current, n = OomPolicy(), loaded, 2  # a window of two loaded micro-batches when loaded as given
    window = loaded if whole else loaded * n
    while True:
        plan = Plan(window, 1, 1, window) if whole else None
        plan = policy.smaller(InForce(plan, current if current != loaded else None, 1, whole, loaded, window))
        if current == 1:
            assert plan is None
            return
        fewest = min(-(-loaded // c) for c in range(1, current))
        best = min(c for c in range(1, current) if -(-loaded // c) == fewest)
        assert plan.micro_batch_size == best and plan.target_batch_size == window
        current = best


def test_smaller_keeps_the_checkpointing_level():
    now = InForce(Plan(4, 2, 1, 8, levers={"checkpointing": {"layers": 3, "of": 8}}), None, 1, True, 8, 8)
    plan = OomPolicy().smaller(now)
    assert (plan.checkpointed_layers, plan.num_layers) == (3, 8)


def test_smaller_tokens():
    policy = OomPolicy()
    smaller = policy.smaller_tokens(TokenBudget(400), longest=100)
    assert smaller is not None and smaller.tokens == 300
    assert policy.smaller_tokens(TokenBudget(100), longest=100) is None  # 75 tokens cannot hold the longest row
