"""The loss kernel and the token budget chosen together (``micro_batching="tokens"``): pure functions of lengths.

In "tokens" mode a loss kernel changes two things at once: what a forward costs (its step-time model,
`step_time.fit_step_time`) and how many tokens a forward may hold (its `TokenBudget`, measured under it). A kernel
faster per forward that holds more memory per token gets a smaller budget, so a window takes more forwards, each
paying what a forward costs beyond its tokens. So kernels are compared by whole steps: each kernel's budget cuts the same windows of the
user's data as training would (`partition_padded`), and its step-time model gives the modelled seconds per optimizer
step; the least wins (to the microsecond), the earlier in ``order`` (registration order: a library's before ours)
on a tie. A kernel
whose probe timed no step-time model cannot be compared by time: it is left out while another has one; where none
has, the fewest forwards per step win (the most tokens per forward on a tie, then ``order``).

"samples" mode keeps the forward-level choice (`levers.kernels.base.choose` at the planned micro-batch): every kernel
that fits runs the same forwards there, so its step time is the forward's times the same count.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .token_budget import TokenBudget, modelled_seconds, padded_tokens, partition_padded


def data_windows(lengths: Sequence[int], per_rank: int, seed: int = 0) -> list[list[int]]:
    """The user's data as windows of ``per_rank`` lengths, one fixed shuffle (the same every call): what the plan's
    expected figures and the kernel comparison cut."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return [[lengths[i] for i in order[w:w + per_rank]] for w in range(0, len(order), per_rank)]


def cut_figures(windows: list[list[int]], budget: TokenBudget) -> dict[str, float | None]:
    """What ``budget`` cuts ``windows`` into, per optimizer step: forwards, padded / real tokens, and the modelled
    seconds by its step-time model (None without one)."""
    cuts = [partition_padded(w, budget) for w in windows]
    real = sum(sum(w) for w in windows) or 1
    seconds = None
    if budget.step_time is not None:
        seconds = sum(modelled_seconds(budget.step_time, w, c) for w, c in zip(windows, cuts)) / len(windows)
    return {"forwards_per_step": sum(map(len, cuts)) / len(windows),
            "padded_over_real": sum(padded_tokens(w, c) for w, c in zip(windows, cuts)) / real,
            "step_seconds": seconds}


def agreed(figures: dict[str, dict], max_of) -> dict[str, dict]:
    """Every rank's figures made one: ``max_of`` (the collective's MAX over ranks, of integers) of each kernel's
    figures in microseconds and ten-thousandths, so the slowest rank's step sets the pace and every rank chooses the
    same kernel (each rank cuts its own windows; a cost model may differ by rank). A kernel with a step-time model on
    some rank counts as modelled (-1 stands for none)."""
    keys = ("step_seconds", "forwards_per_step", "padded_over_real")
    scale = {"step_seconds": 1e6, "forwards_per_step": 1e4, "padded_over_real": 1e4}
    names = list(figures)
    flat = tuple(-1 if figures[n][k] is None else round(figures[n][k] * scale[k]) for n in names for k in keys)
    out = iter(max_of(flat))
    return {n: {k: (None if v < 0 else v / scale[k]) for k in keys for v in [next(out)]} for n in names}


def choose_kernel(budgets: dict[str, TokenBudget], windows: list[list[int]],
                  order: Sequence[str] | None = None, max_of=None) -> dict:
    """The plan's ``loss_kernel`` record in "tokens" mode: of ``budgets`` (kernel name -> the token budget measured
    under it, with its step-time model), the kernel whose whole steps over ``windows`` model least (see the module
    docstring), with what each kernel's budget gives: ``step_seconds`` (modelled, per optimizer step; only kernels
    with a model), ``forwards_per_step``, ``padded_over_real``, ``tokens_per_forward``, and ``by``: "step time" or
    "forwards (no step-time model)". ``max_of``: with several ranks, their figures made one first (`agreed`)."""
    if not budgets:
        raise ValueError("choose_kernel: no kernel's token budget to choose from")
    rank = {name: i for i, name in enumerate(order or budgets)}
    figures = {name: cut_figures(windows, b) for name, b in budgets.items()}
    if max_of is not None:
        figures = agreed(figures, max_of)
    # compared as the record keeps them (microseconds): rounding alone never decides, the order does
    timed = {name: round(f["step_seconds"], 6) for name, f in figures.items() if f["step_seconds"] is not None}

    def position(name: str) -> int:
        return rank.get(name, len(rank))

    if timed:
        kernel, by = min(timed, key=lambda n: (timed[n], position(n))), "step time"
    else:
        kernel = min(budgets, key=lambda n: (figures[n]["forwards_per_step"], -budgets[n].tokens, position(n)))
        by = "forwards (no step-time model)"
    return {"kernel": kernel, "by": by, "micro_batching": "tokens",
            "step_seconds": timed,
            "forwards_per_step": {n: round(f["forwards_per_step"], 4) for n, f in figures.items()},
            "padded_over_real": {n: round(f["padded_over_real"], 4) for n, f in figures.items()},
            "tokens_per_forward": {n: b.tokens for n, b in budgets.items()}}
