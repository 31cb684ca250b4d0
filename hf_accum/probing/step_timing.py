"""A token budget's step times (``micro_batching="tokens"``): at the length a probe measured, plain optimizer steps
(no profiler; on CPU the process's CPU time) under the lever level and the loss kernel it chose, of one forward at
its largest fit ``top``, half of it, a quarter, ... down to one row, and the optimizer's step alone (its gradients as
a step leaves them: zeroed, not freed).

A forward of ``r`` rows costs its step less the optimizer's, which a window pays once: `window.step_time.fit_step_time`
turns them into the model by which a window is cut into the number of forwards with the least modelled step time.
Every size is timed because no fixed cost per forward plus a cost per token describes a forward (issue 57): a line
through two sizes showed steps proportional to their rows, while a window's step rose with each forward more; and
the same rows cut in two, whose difference was to be a forward's fixed cost, came out anywhere from -13 to +24 ms
(benchmarks/bench_token_budget.py part 4: cutting a large forward in two costs about nothing on a CPU, where smaller
forwards run faster per token, and a forward more of a few rows costs milliseconds). The sizes a window's cuts use lie
between one row and the largest fit: each is measured, not extrapolated. Nothing is timed on paper (the estimate's
fake tensors take no time)."""

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


def sizes(top: int) -> list[int]:
    """The rows timed in one forward: ``top``, half of it, a quarter, ... down to one row."""
    out, rows = [], top
    while rows >= 1:
        out.append(rows)
        rows //= 2
    return out[::-1]


def time_rows(result: ProbeResult, step_fn: Callable[..., None], meter, lever: Any,
              model) -> tuple[dict[str, float], float | None]:
    """``({rows: seconds}, optimizer seconds)`` (JSON keys), the slowest rank's: one optimizer step of one forward at
    each of `sizes` (``step_fn(rows)``: `probe.make_step_fn`), and the optimizer's step alone (``step_fn(0)``). Empty
    and None where nothing fits, on paper, or after an out-of-memory error."""
    top = result.max_micro_batch_size
    if top < 1 or meter.name == "estimate":
        return {}, None
    level = (result.extra.get("checkpointing") or {}).get("chosen_k")
    kernel = (result.extra.get("loss_kernel") or {}).get("kernel")
    # every rank agreed on top: every rank times the same steps, as _slowest_rank needs
    steps = [(rows, lambda rows=rows: step_fn(rows)) for rows in (*sizes(top), 0)]
    best: list[float | None] = [None] * len(steps)
    with contextlib.nullcontext() if lever is None or level is None else lever.at(level), pinned(model, kernel):
        for _ in range(REPEATS):  # the steps in turn, not each's repeats in a row: a drift moves all alike
            for i, (rows, step) in enumerate(steps):
                took, _oom = guarded(lambda step=step, rows=rows: _time(meter, step, rows))
                best[i] = took if best[i] is None or (took is not None and took < best[i]) else best[i]
    seconds: dict[str, float] = {}
    optimizer = None
    for (rows, _), fastest in zip(steps, best):
        took = _slowest_rank(fastest or 0.0)  # every rank takes part, whatever its own outcome
        if took > 0 and rows:
            seconds[str(rows)] = took
        elif took > 0:
            optimizer = took
    return seconds, optimizer


def _time(meter, step: Callable[[], None], rows: int) -> float:
    """Seconds of one ``step()``: on CPU this process's CPU time (its threads' work, which a machine shared with other
    processes does not stretch as it stretches wall time), elsewhere the meter's (CUDA: synchronized wall time)."""
    if meter.name != "cpu":
        return meter.time(step, micro_batch_size=rows)
    start = time.process_time()
    step()
    return time.process_time() - start
