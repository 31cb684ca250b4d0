"""A token budget's step times (``micro_batching="tokens"``): at the length a probe measured, plain optimizer steps
(no profiler; on CPU the process's CPU time) under the lever level and the loss kernel it chose, of
- its largest fit ``top`` in one forward (A),
- half of it, ``top // 2`` rows, in one forward (C),
- the same ``top`` rows cut into two forwards (an odd ``top`` as evenly as it goes), gradients accumulated, one
  optimizer step (B).

With a forward of ``r`` rows costing ``f(r)`` and the optimizer's step ``O``, ``A - C`` is the tokens' cost of the
rows between the two sizes, and ``B - A`` a forward's fixed cost: the same tokens, one forward more, and ``O`` in
both. The fixed cost of a line through A and C holds ``O`` too, which a window pays once, not once per forward:
charged to every forward, it makes a forward look dearer than it is and the cut take too few. Nor does a line through
two sizes of one forward without the optimizer show a forward's own fixed cost: such steps came out proportional to
their rows (a fixed cost of 0, the cut then taking far too many forwards), while a window's measured step time rose
with each forward more (issue 57). Only the same rows cut two ways show it. `window.token_budget.fit_step_time` turns
the three into a forward's fixed cost and its cost per padded token, by which the window is cut into the number of
forwards with the least modelled step time. Nothing is timed on paper (the estimate's fake tensors take no time)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from ..window.oom import guarded
from .kernel_timing import pinned
from .levels import _slowest_rank
from .loop import ProbeResult

REPEATS = 3  # each step timed three times, the fastest kept: a shared machine's hiccup is not the step's cost


def time_rows(result: ProbeResult, step_fn: Callable[..., None], meter, lever: Any,
              model) -> tuple[dict[str, float], dict[str, float]]:
    """``({rows: seconds}, {rows: seconds})`` (JSON keys), the slowest rank's: one optimizer step of one forward at
    the largest fit and at half of it, and one of the largest fit's rows in two forwards (``step_fn(rows,
    forwards=2)``: `probe.make_step_fn`; none at a largest fit of one row, which cannot be cut). Empty where nothing
    fits, on paper, or after an out-of-memory error."""
    top = result.max_micro_batch_size
    if top < 1 or meter.name == "estimate":
        return {}, {}
    level = (result.extra.get("checkpointing") or {}).get("chosen_k")
    kernel = (result.extra.get("loss_kernel") or {}).get("kernel")
    steps = [("one", rows, lambda rows=rows: step_fn(rows)) for rows in sorted({max(1, top // 2), top})]
    if top >= 2:  # every rank agreed on top: every rank times the same steps, as _slowest_rank needs
        steps.append(("two", top, lambda: step_fn(top, forwards=2)))
    best: list[float | None] = [None] * len(steps)
    with contextlib.nullcontext() if lever is None or level is None else lever.at(level), pinned(model, kernel):
        for _ in range(REPEATS):  # the steps in turn, not each's repeats in a row: a drift moves all alike
            for i, (_, rows, step) in enumerate(steps):
                took, _oom = guarded(lambda step=step, rows=rows: _time(meter, step, rows))
                best[i] = took if best[i] is None or (took is not None and took < best[i]) else best[i]
    seconds: dict[str, dict[str, float]] = {"one": {}, "two": {}}
    for (forwards, rows, _), fastest in zip(steps, best):
        took = _slowest_rank(fastest or 0.0)  # every rank takes part, whatever its own outcome
        if took > 0:
            seconds[forwards][str(rows)] = took
    return seconds["one"], seconds["two"]


def _time(meter, step: Callable[[], None], rows: int) -> float:
    """Seconds of one ``step()``: on CPU this process's CPU time (its threads' work, which a machine shared with other
    processes does not stretch as it stretches wall time), elsewhere the meter's (CUDA: synchronized wall time)."""
    if meter.name != "cpu":
        return meter.time(step, micro_batch_size=rows)
    start = time.process_time()
    step()
    return time.process_time() - start
