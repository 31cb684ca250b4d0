"""The probe across the levels of any registered lever (`levers.base.Levels`: positions 0..count, memory falling as
the position grows): the micro-batch search at the lever's anchors, the step-time lines, and
`probing.level_choice.CheckpointChooser`'s proposals, interpolating between the anchors, verified by real steps
(`probe_levels`). Every rank agrees on every measured figure, so all choose the same.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..window.oom import guarded
from .level_choice import CheckpointChooser, Choice, Level, fit_time_line, scale_line
from .loop import (
    Log,
    ProbeResult,
    StepFn,
    Trial,
    _dist_device,
    _distributed,
    _run_trial,
    agree_max_micro_batch,
    probe_micro_batches,
)
from .meters import Meter
from .search import MicroBatchSearch

MAX_VERIFY_STEPS = 3  # verifying steps before the chooser falls back to a measured point


def probe_levels(step_fn: StepFn, meter: Meter, budget_bytes: int, cap: int, per_rank: int, lever: Any, *,
                 must_resolve: Sequence[int] = (), log: Log | None = None,
                 seeds: dict[int, int] | None = None) -> ProbeResult:
    """Choose the micro-batch and how many of the ``lever.num_layers`` layers recompute, by measurement.

    1. the micro-batch search without checkpointing (k = 0); when the whole per-rank window (or the cap) fits, that
       is the answer: recompute only adds time;
    2. otherwise the same search with every layer checkpointed (k = L), reusing the optimizer state;
    3. the step-time lines: the searches' own timings give each level's shape, and one plain step (no meter
       instrumentation) at the cheapest level's largest fit levels them all (`_levels`);
    4. `levers.CheckpointChooser` proposes the fastest predicted (rows, k); a proposal no measurement covers is
       verified by a real step (at most `MAX_VERIFY_STEPS`, then the best measured point).
    ``seeds``: position -> an estimate of its largest fit (`seed.py`, the level search on paper): that anchor's
    micro-batch search starts there (`MicroBatchSearch`'s ``seed``); an anchor without one starts from 1.
    Ranks agree on every measured figure (the most constrained rank's), so all make the same choice. The result's
    ``max_micro_batch_size`` is the chosen rows per forward (0: nothing fits even with every layer checkpointed);
    ``extra["checkpointing"]`` records the levels, the choice and its predicted seconds per optimizer step."""
    say = log or (lambda _msg: None)
    num_layers = lever.count
    results: dict[int, ProbeResult] = {}
    for position in lever.anchors:  # memory falls along the anchors: stop at the first holding the whole window
        say(f"{lever.name} level {position} of {num_layers} ({_words(lever, position)})")
        with lever.at(position):
            results[position] = probe_micro_batches(
                step_fn, meter, budget_bytes, cap, must_resolve=must_resolve, log=log,
                warmup=not results or results[0].warmup_seconds is None, seed=(seeds or {}).get(position))
        if agree_max_micro_batch(results[position].max_micro_batch_size) >= cap:
            break
    trials: list[Trial] = []
    for k, r in results.items():
        for t in r.trials:
            t.checkpointed_layers = k
            trials.append(t)
    measured, timed = _levels(results, step_fn, meter, lever)
    levels = _agree_levels(measured)
    # every input of the chooser equal on all ranks, so all make the same proposals (and verifying steps, each one
    # collective): the tightest rank's budget with the agreed levels
    chooser = CheckpointChooser(per_rank, num_layers, _tightest_budget(budget_bytes), levels, cap=cap)
    steps = _verify(chooser, step_fn, meter, MicroBatchSearch(budget_bytes, cap), lever, trials, say)
    accepted, seconds, checked = _timed_choice(chooser, timed, per_rank, step_fn, meter, lever)
    base = results[accepted.k] if accepted is not None and accepted.k in results else results[max(results)]
    result = dataclasses.replace(base, trials=trials, extra=dict(base.extra))
    result.max_micro_batch_size = accepted.micro if accepted is not None else 0
    result.chosen_micro_batch_size = None
    result.extra["checkpointing"] = _record(accepted, seconds, checked, levels, steps, lever, say)
    return result


def _words(lever: Any, position: int) -> str:
    """A position as the plan would say it ("none" at 0)."""
    record = lever.record(position)
    return "none" if position == 0 else ", ".join(f"{k} {v}" for k, v in record.items() if k != "of")


def _verify(chooser: CheckpointChooser, step_fn: StepFn, meter: Meter, verify: MicroBatchSearch, lever: Any,
            trials: list[Trial], say: Log) -> int:
    """Real steps at the chooser's proposals no measurement covers, until one is accepted (at most
    `MAX_VERIFY_STEPS`, then the best measured point). Appends the trials; returns how many steps ran."""
    limit = None if meter.catches_oom else meter.capacity_bytes() - meter.unavailable_bytes()
    steps = 0
    choice = chooser.propose()
    while choice is not None and chooser.accepted is None:
        if steps == MAX_VERIFY_STEPS:
            chooser.accepted = chooser.best_verified()
            break
        steps += 1
        with lever.at(choice.k):
            trial = _run_trial(step_fn, meter, verify, choice.micro, limit, say)
        trial.checkpointed_layers = choice.k
        trials.append(trial)
        chooser.record(choice, agree_max_micro_batch(int(trial.fits)) == 1)
        choice = chooser.propose()
    return steps


def _record(accepted: Choice | None, seconds: float, checked: dict[str, Any] | None, levels: list[Level], steps: int,
            lever: Any, say: Log) -> dict[str, Any]:
    """What the level search records in the probe result (``extra["checkpointing"]``), said once: the positions
    measured, the one chosen (``chosen_k``) and the plan's record of it (``lever``, ``plan_record``)."""
    num_layers = lever.count
    record: dict[str, Any] = {
        "lever": lever.name,
        "num_layers": num_layers,
        "levels": [dataclasses.asdict(lv) for lv in levels],
        "verify_steps": steps,
        "chosen_k": accepted.k if accepted is not None else num_layers,
    }
    record["plan_record"] = lever.record(record["chosen_k"])
    if checked is not None:
        record["checked_against"] = checked
    if accepted is not None:
        record["step_seconds"] = accepted.forwards * seconds if seconds else accepted.predicted_seconds
        record["chosen"] = dataclasses.asdict(accepted)
        timed = "" if record["step_seconds"] is None else f", ~{record['step_seconds']:.3f} s per optimizer step"
        say(f"chosen: {accepted.micro} rows per forward, {accepted.forwards} forwards, {lever.name} level {accepted.k} of "
            f"{num_layers} ({_words(lever, accepted.k)}){timed}")
    return record


def _timed_choice(chooser: CheckpointChooser, timed: tuple[int, int, float] | None, per_rank: int, step_fn: StepFn,
                  meter: Meter, lever: Any) -> tuple[Choice | None, float, dict[str, Any] | None]:
    """The accepted choice, its plain seconds per forward (the slowest rank's; 0.0 when untimed) and what it was
    checked against. A choice other than the plainly timed point is timed plainly too, and the two are compared as
    measured: the timed point (a level's largest fit, measured to fit) wins when its optimizer step is faster, so
    one noisy instrumented step cannot choose recompute that does not pay. Every input is equal on all ranks."""
    accepted = chooser.accepted
    if accepted is None:
        return None, 0.0, None
    at_timed = timed is not None and timed[:2] == (accepted.micro, accepted.k)
    seconds = timed[2] if at_timed else _timed_step(step_fn, meter, lever, accepted.micro, accepted.k)  # not run twice
    seconds = _slowest_rank(seconds or 0.0)
    if timed is None or at_timed:
        return accepted, seconds, None
    micro, k, other = timed
    other = _slowest_rank(other)
    forwards = math.ceil(per_rank / micro)
    checked = {"micro": micro, "k": k, "forwards": forwards, "step_seconds": forwards * other}
    if seconds and other and forwards * other < accepted.forwards * seconds:
        rows = math.ceil(per_rank / forwards)
        accepted = Choice(rows, k, forwards, chooser.predict_bytes(rows, k), forwards * other, True)
        return accepted, other, checked
    return accepted, seconds, checked


def _levels(results: dict[int, ProbeResult], step_fn: StepFn, meter: Meter,
            lever: Any) -> tuple[list[Level], tuple[int, int, float] | None]:
    """What the chooser needs of each measured level: the memory line, and the step-time line through the search's
    timings. Those ran under the meter's instrumentation (on CPU a profiler), so one plain step at the level whose
    largest fit holds the fewest rows gives the ratio of plain to instrumented seconds, and every line is scaled by
    it: one extra step, the cheapest, instead of one per level (the full level's largest fit is often the whole
    window, the probe's dearest step). The level is chosen from agreed figures, so every rank times the same one.
    Returns the levels and the plainly timed step as (micro, k, seconds), None when no level fits."""
    lines = {}
    for k, result in results.items():
        lines[k] = fit_time_line([(t.micro_batch_size, t.seconds) for t in result.trials if t.fits and t.seconds])
    # the largest fit every rank has (ranks with different budgets differ): which step is timed, and at how many rows,
    # must be the same everywhere, since what follows compares it through collectives
    largest = {k: agree_max_micro_batch(r.max_micro_batch_size) for k, r in results.items()}
    timeable = [k for k in results if largest[k] >= 1]
    timed = None
    ratio = None
    if timeable:
        k = min(timeable, key=lambda k: (largest[k], k))
        micro = largest[k]
        seconds = _timed_step(step_fn, meter, lever, micro, k)
        instrumented = lines[k][0] + lines[k][1] * micro if lines[k] is not None else 0.0
        timed = (micro, k, seconds or 0.0)  # the same point on every rank (an OOM here is one rank's: 0.0)
        if seconds and instrumented > 0:
            ratio = seconds / instrumented
    levels = []
    for k, result in results.items():
        time = lines[k]
        if time is not None and ratio is not None:
            time = scale_line(time, ratio)
        failure = min((t.micro_batch_size for t in result.trials if not t.fits), default=None)
        levels.append(Level(k, result.max_micro_batch_size, failure, result.fitted, time))
    return levels, timed


def _timed_step(step_fn: StepFn, meter: Meter, lever: Any, micro: int, k: int) -> float | None:
    def timed() -> float:
        with lever.at(k):
            return meter.time(lambda: step_fn(micro), micro_batch_size=micro)

    return guarded(timed)[0]  # None after an out-of-memory error


def _tightest_budget(budget_bytes: float) -> float:
    """The smallest budget of all ranks (a rank sharing its device has less)."""
    return _over_ranks(budget_bytes, "MIN")


def _slowest_rank(seconds: float) -> float:
    """A data-parallel step lasts as long as its slowest rank: the MAX over ranks."""
    return _over_ranks(seconds, "MAX")


def _over_ranks(value: float, op: str) -> float:
    if not _distributed():
        return value
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=_dist_device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return float(t.item())


def _agree_levels(levels: list[Level]) -> list[Level]:
    """Every rank's levels replaced by the most constrained: the smallest fits and failures, the largest lines, a line
    only where every rank has one (so the chooser's inputs, and with them its proposals, are equal on all ranks)."""
    if not _distributed():
        return levels
    import torch.distributed as dist

    big = float(2**62)
    rows = []
    for lv in levels:
        rows.append([-lv.largest_fit, -(lv.smallest_failure or big), -float(lv.memory is not None),
                     -float(lv.time is not None), *(lv.memory or (0.0, 0.0)), *(lv.time or (0.0, 0.0))])
    t = torch.tensor(rows, dtype=torch.float64, device=_dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = []
    for lv, row in zip(levels, t.tolist()):
        failure = None if -row[1] >= big else int(-row[1])
        memory = (row[4], row[5]) if row[2] == -1.0 else None
        time = (row[6], row[7]) if row[3] == -1.0 else None
        out.append(Level(lv.k, int(-row[0]), failure, memory, time))
    return out
