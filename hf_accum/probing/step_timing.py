"""A token budget's step times (``micro_batching="tokens"``): at the length a probe measured, plain steps (no
profiler; on CPU the process's CPU time) at its largest fit and at half of it, under the lever level and the loss kernel it chose. Two sizes give
a forward's fixed cost and its cost per padded token (`window.token_budget.fit_step_time`), by which the window is
cut into the number of forwards with the least modelled step time. Nothing is timed on paper (the estimate's fake
tensors take no time)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from ..window.oom import guarded
from .kernel_timing import pinned
from .levels import _slowest_rank
from .loop import ProbeResult

REPEATS = 3  # each size timed three times, the fastest kept: a shared machine's hiccup is not the step's cost


def time_rows(result: ProbeResult, step_fn: Callable[[int], None], meter, lever: Any, model) -> dict[str, float]:
    """``{rows: seconds}`` (JSON keys) of one optimizer step at the largest fit and half of it, the slowest rank's;
    empty where nothing fits, on paper, or after an out-of-memory error."""
    top = result.max_micro_batch_size
    if top < 1 or meter.name == "estimate":
        return {}
    level = (result.extra.get("checkpointing") or {}).get("chosen_k")
    kernel = (result.extra.get("loss_kernel") or {}).get("kernel")
    seconds: dict[str, float] = {}
    with contextlib.nullcontext() if lever is None or level is None else lever.at(level), pinned(model, kernel):
        for rows in sorted({max(1, top // 2), top}):
            best = None
            for _ in range(REPEATS):
                took, _oom = guarded(lambda rows=rows: _time(meter, lambda: step_fn(rows), rows))
                best = took if best is None or (took is not None and took < best) else best
            best = _slowest_rank(best or 0.0)  # every rank takes part, whatever its own outcome
            if best > 0:
                seconds[str(rows)] = best
    return seconds


def _time(meter, step: Callable[[], None], rows: int) -> float:
    """Seconds of one ``step()``: on CPU this process's CPU time (its threads' work, which a machine shared with other
    processes does not stretch as it stretches wall time), elsewhere the meter's (CUDA: synchronized wall time)."""
    if meter.name != "cpu":
        return meter.time(step, micro_batch_size=rows)
    start = time.process_time()
    step()
    return time.process_time() - start
