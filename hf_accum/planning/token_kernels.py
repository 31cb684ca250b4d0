"""The token budget measured under each loss kernel, and the kernel chosen by whole steps (``micro_batching="tokens"``,
issue 57 item 2). Where two or more kernels could run (`probing.kernel_timing.candidates`), the token measurement
(`tokens.token_plan`: the probes at the longest, the shortest and a middle length, their timed steps) runs once per
kernel, each pinned; the first from the usual start (the estimate), the others' searches seeded by the first's rows
at each length (a seed costs trials, never the answer). `window.kernel_budget.choose_kernel` then cuts the user's
windows with each kernel's budget and step-time model and takes the kernel whose steps model least. The plan keeps
the chosen kernel's budget, cost model and step-time model, and the ``loss_kernel`` record says what each kernel
gave, so a stored plan cuts the same window the same way. A lever level (``checkpoint_layers="auto"``) is chosen
once, by the first kernel's probe, and every kernel is measured at it. One kernel, a pinned one, or a probe inside a
sharded engine's loop: measured once, as before.
"""

from __future__ import annotations

import dataclasses

from ..probing.kernel_timing import pinned
from ..probing.loop import NothingFitsError, ProbeResult
from ..probing.plan import Plan
from ..window.kernel_budget import choose_kernel, data_windows
from ..window.token_budget import TokenBudget, plan_budget
from .tokens import token_plan


def measure_tokens(trainer, probe, prepared, kernels: list[str]) -> tuple[Plan, ProbeResult]:
    """The tokens-mode plan and what its probe measured; ``kernels``: the loss kernels to compare (none or one:
    measured as the probe runs, the kernel chosen at the forward as "samples" mode does)."""
    if len(kernels) < 2:
        return _measured(trainer, probe, prepared)
    measured: dict[str, tuple[Plan, ProbeResult]] = {}
    refused: dict[str, NothingFitsError] = {}
    for name in kernels:
        first = next(iter(measured.values()), None)
        with pinned(trainer.model, name):
            try:
                measured[name] = _measured(trainer, probe if first is None else _seeded(probe, plan_budget(first[0])),
                                           prepared)
            except NothingFitsError as exc:  # this kernel holds too much even for one row: the others may fit
                refused[name] = exc
    if not measured:
        raise next(iter(refused.values()))
    per_rank = trainer.args.target_batch_size // trainer.args.world_size
    windows = data_windows(prepared.lengths, per_rank) if prepared.lengths else [[prepared.seq_len] * per_rank]
    collective = trainer._collective()  # every rank the same kernel: the slowest rank's figures decide
    record = choose_kernel({name: plan_budget(plan) for name, (plan, _) in measured.items()}, windows, kernels,
                           max_of=collective.max_of if collective.world > 1 else None)
    if refused:
        record["nothing_fits"] = sorted(refused)
    (first_plan, first_result), (plan, result) = next(iter(measured.values())), measured[record["kernel"]]
    if "checkpointing" in first_result.extra:  # the level chosen once, by the first kernel's probe: every kernel's
        result.extra.setdefault("checkpointing", first_result.extra["checkpointing"])
    result.extra["loss_kernel"] = record
    result.extra["token_kernels"] = {name: r.extra.get("token_budget") for name, (_, r) in measured.items()}
    levers = {**(first_plan.levers or {}), **(plan.levers or {}), "loss_kernel": record}
    return dataclasses.replace(plan, levers=levers, step_seconds=plan.step_seconds or first_plan.step_seconds), result


def _measured(trainer, probe, prepared) -> tuple[Plan, ProbeResult]:
    """One token measurement: the probe at the longest example, then `token_plan`; the levers the first probe chose."""
    result, chosen = probe(prepared.make_batch, prepared.seq_len)
    plan, result = token_plan(trainer, chosen, result, prepared.seq_len, probe, prepared.lengths)
    return dataclasses.replace(plan, levers=chosen.levers, step_seconds=chosen.step_seconds), result


def _seeded(probe, budget: TokenBudget):
    """``probe`` with each length's search started at the rows ``budget`` (another kernel's) holds there."""
    def seeded(make_batch, length, **kwargs):
        return probe(make_batch, length, seed=max(1, budget.rows(length)), **kwargs)

    return seeded
