"""What the plan becomes after an out-of-memory error: one policy object, injectable into the `Planner` (as
accelerate's `find_executable_batch_size` takes a `reduce_batch_size_fn`).

Pure: numbers in, a plan (or None: nothing smaller keeps the target) out. The planner applies what it returns.
`larger()` is what growing back returns to, once `GrowBack` (growback.py) says the lowered plan has run long enough.
"""

from __future__ import annotations

import dataclasses

from ..probing.plan import Plan
from ..window.cuts import forwards_for
from ..window.token_budget import TokenBudget


@dataclasses.dataclass(frozen=True)
class InForce:
    """What the run loads and cuts now, as the policy needs it."""

    plan: Plan | None  # the plan applied (None: the user's micro-batch and accumulation, no plan)
    units: int | None  # the engine's cut in force (None: each loaded batch is one forward)
    world: int
    whole_windows: bool  # each rank loads its whole window and the engine cuts it
    micro: int  # per_device_train_batch_size as loaded
    target: int  # the effective batch to keep


class OomPolicy:
    """The default, one rule for windows loaded whole and for micro-batches loaded as given: the largest cut below
    the one that failed that needs the fewest forwards per loaded batch (one forward more, near-equal: the window
    when loaded whole, the user's micro-batch when loaded as given); a token budget shrinks to three quarters."""

    token_factor = 0.75

    def smaller(self, now: InForce) -> Plan | None:
        """The next smaller plan for ``now``'s target, keeping the checkpointing level the model has; None at 1."""
        whole = now.whole_windows and now.plan is not None
        current = now.units or (now.plan.micro_batch_size if whole else now.micro)
        if current <= 1:
            return None
        target = now.plan.target_batch_size if whole else now.target
        window = target // now.world
        loaded = window if whole else min(now.micro, window)  # what each forward is cut from
        cut = forwards_for(loaded, forwards_for(loaded, current - 1))  # fewest forwards below current, largest cut
        return _keeping_level(now.plan, Plan(cut, forwards_for(window, cut), now.world, target))

    def smaller_tokens(self, budget: TokenBudget, longest: int) -> TokenBudget | None:
        """micro_batching="tokens": a smaller budget (same samples, same windows); None when it could not hold the
        window's ``longest`` unit."""
        smaller = budget.scaled(self.token_factor)
        return smaller if smaller.rows(longest) >= 1 else None

    def larger(self, now: InForce, before: Plan) -> Plan | None:
        """Growing back (growback.py says when): the plan in force before the first OOM lowered it, keeping an eval
        batch measured since (the lowering dropped it); None when that plan is already in force."""
        if now.plan == before:
            return None
        measured = now.plan.eval_batch_size if now.plan is not None else None
        return dataclasses.replace(before, eval_batch_size=measured or before.eval_batch_size)


def as_plan(now: InForce) -> Plan:
    """What is in force as a plan: the applied plan, or the user's micro-batches as loaded (auto_tune off)."""
    if now.plan is not None:
        return now.plan
    return Plan(now.micro, forwards_for(now.target // now.world, now.micro), now.world, now.target)


def _keeping_level(current: Plan | None, plan: Plan) -> Plan:
    """A smaller plan after an OOM: the model keeps its lever levels, so the plan says so."""
    if current is None or not current.levers:
        return plan
    return dataclasses.replace(plan, levers=current.levers)
