"""The planner's OOM policy (planning/policy.py) is pure: what a plan lowers to after an out-of-memory error, as a
table of cases (growing back, `larger`, is tabled in tests/test_growback.py)."""

import pytest

from hf_accum.planning.plan import Plan
from hf_accum.planning.policy import InForce, OomPolicy
from hf_accum.token_budget import TokenBudget


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        # windows loaded whole: one forward more per window, near-equal (no divisor needed)
        (InForce(Plan(5, 2, 1, 10), None, 1, True, 10, 10), (4, 3)),
        (InForce(Plan(5, 2, 1, 10), 3, 1, True, 10, 10), (2, 5)),  # from the engine's cut in force
        (InForce(Plan(1, 10, 1, 10), None, 1, True, 10, 10), None),  # nothing below 1
        # micro-batches loaded as given: the next smaller divisor of the per-rank target
        (InForce(None, None, 2, False, 4, 16), (2, 4)),
        (InForce(None, 2, 2, False, 4, 16), (1, 8)),
        (InForce(None, None, 1, False, 1, 8), None),
    ],
)
def test_smaller(now, expected):
    plan = OomPolicy().smaller(now)
    assert (None if plan is None else (plan.micro_batch_size, plan.gradient_accumulation_steps)) == expected
    if plan is not None:
        assert plan.target_batch_size == now.target and plan.world_size == now.world  # the target is kept


def test_smaller_keeps_the_checkpointing_level():
    now = InForce(Plan(4, 2, 1, 8, levers={"checkpointing": {"layers": 3, "of": 8}}), None, 1, True, 8, 8)
    plan = OomPolicy().smaller(now)
    assert (plan.checkpointed_layers, plan.num_layers) == (3, 8)


def test_smaller_tokens():
    policy = OomPolicy()
    smaller = policy.smaller_tokens(TokenBudget(400), longest=100)
    assert smaller is not None and smaller.tokens == 300
    assert policy.smaller_tokens(TokenBudget(100), longest=100) is None  # 75 tokens cannot hold the longest row
