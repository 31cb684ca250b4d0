"""The probe loop: real training steps at the micro-batch sizes `probing.search.MicroBatchSearch` proposes, through a
meter (`probe_micro_batches`), what it measured (`Trial`, `ProbeResult`), and the ranks' agreement on it.

One warm-up step (not a trial: it creates the optimizer's state), then the trials the search proposes; an
out-of-memory error means "does not fit". `probe.py` builds the step and calls this; `levels.py` runs it at
several checkpointing levels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..config.fit_hints import fit_hints
from ..window.oom import guarded
from .meters import Meter, format_bytes
from .plan import choose_fastest
from .search import MicroBatchSearch

StepFn = Callable[[int], Any]
MakeBatch = Callable[[int], dict[str, Any]]  # micro_batch_size -> collated batch at the worst-case length
Log = Callable[[str], None]

DEFAULT_BUDGET_FRACTION = 0.9


@dataclass
class Trial:
    """One micro-batch size the probe tried.  ``status``: "fits", "over budget", "out of memory", or
    "refused" (on CPU: predicted over the memory this process can get, never run)."""

    micro_batch_size: int
    peak_bytes: int | None
    reserved_bytes: int | None
    seconds: float | None
    fits: bool
    status: str
    predicted_bytes: float | None = None
    baseline_bytes: int | None = None  # held before the step (weights, gradients, optimizer state): its base
    checkpointed_layers: int | None = None  # the checkpointing level it ran at, when the probe tried levels

    @property
    def samples_per_second(self) -> float | None:
        return self.micro_batch_size / self.seconds if self.seconds else None


@dataclass
class ProbeResult:
    """What the probe measured and concluded.

    ``max_micro_batch_size``: the largest size measured to fit (0: none).  ``fitted``: the memory line
    ``(a, b)`` (bytes ≈ a + b·micro) from the points nearest the budget, None with fewer than two.
    ``next_size``/``next_verdict``: the smallest plan-usable size above the maximum and how it is known
    not to fit: "measured" (it ran, or was refused, and did not fit), "predicted" (by the line) or
    "cap" (no size is left under the cap).  ``chosen_micro_batch_size``: the throughput mode's pick.
    """

    trials: list[Trial]
    max_micro_batch_size: int
    fitted: tuple[float, float] | None
    budget_bytes: int
    capacity_bytes: int
    max_micro_batch: int
    next_size: int | None = None
    next_verdict: str = "cap"
    warmup_seconds: float | None = None
    device: str = ""
    optimize: str = "memory"
    chosen_micro_batch_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def measured_trials(self) -> list[Trial]:
        """Trials that actually ran (a refused size did not)."""
        return [t for t in self.trials if t.status != "refused"]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fitted"] = (
            None if self.fitted is None else {"a_bytes": self.fitted[0], "b_bytes_per_sample": self.fitted[1]}
        )
        return out


class NothingFitsError(ValueError):
    """Even micro-batch 1 exceeds the budget; ``result`` holds what was measured."""

    def __init__(self, message: str, result: ProbeResult) -> None:
        super().__init__(message)
        self.result = result


# --- the probe loop ---------------------------------------------------------------------------------------
def probe_micro_batches(
    step_fn: StepFn,
    meter: Meter,
    budget_bytes: int,
    max_micro_batch: int,
    *,
    must_resolve: Sequence[int] = (),
    optimize: str = "memory",
    warmup: bool = True,
    limit_bytes: int | None = None,
    log: Log | None = None,
    seed: int | None = None,
) -> ProbeResult:
    """Find the largest micro-batch whose step fits ``budget_bytes``, measuring real steps.

    ``step_fn(micro)`` runs one complete training step (forward, backward, optimizer step) at that
    micro-batch size and keeps no reference to its tensors.  ``must_resolve``: the sizes a plan can use
    (`plan.forward_breakpoints` of the per-rank target: each the smallest reaching its forward count); the search does not stop while one of them between the largest
    fit and the estimate is unresolved.  ``limit_bytes``: for meters that cannot catch an OOM (CPU), the
    most a step may be predicted to need before it is refused unrun (default: the meter's capacity
    minus what others hold).  ``optimize="throughput"`` also times every fitting size in
    ``must_resolve`` and sets ``chosen_micro_batch_size`` to the one with the least time per optimizer step.
    ``seed``: an estimate of the largest fit to start the search from (`MicroBatchSearch`'s ``seed``).
    """
    if optimize not in ("memory", "throughput"):
        raise ValueError(f'optimize must be "memory" or "throughput", got {optimize!r}')
    say = log or (lambda _msg: None)
    capacity = meter.capacity_bytes()
    if limit_bytes is None and not meter.catches_oom:
        limit_bytes = capacity - meter.unavailable_bytes()
    search = MicroBatchSearch(budget_bytes, max_micro_batch, must_resolve=must_resolve, seed=seed)
    trials: list[Trial] = []
    result = ProbeResult(trials, 0, None, int(budget_bytes), capacity, max_micro_batch, optimize=optimize)
    result.device = str(meter.describe().get("device", meter.name))

    if warmup:
        # The optimizer allocates its state (Adam: two tensors per parameter) in its first step; a trial
        # without it would under-measure every later step by that much.
        upto = f", up to {max_micro_batch}" if max_micro_batch else ""
        # an estimate's meter runs the step on fake tensors: "real" there would say it trained (issue 59's replay)
        step = "real training step" if meter.times_steps else "training step on fake tensors (nothing runs)"
        say(f"searching the largest micro-batch within {format_bytes(budget_bytes, 'MiB')} MiB{upto}, each trial one "
            f"{step}; first a warm-up step at micro-batch 1 (creates the optimizer state; not a trial)")
        result.warmup_seconds, oom = guarded(lambda: meter.time(lambda: step_fn(1), micro_batch_size=1))
        if oom:
            trials.append(Trial(1, None, None, None, False, "out of memory"))
            say("micro-batch 1: out of memory")
            return result
        if meter.times_steps:
            say(f"warm-up step: {result.warmup_seconds:.3f} s")

    while (micro := search.propose()) is not None:
        trials.append(_run_trial(step_fn, meter, search, micro, limit_bytes, say))
    _finish(result, search)

    if optimize == "throughput" and result.max_micro_batch_size > 0:
        _time_fitting_divisors(step_fn, meter, search, result, must_resolve, say)
    return result


def _run_trial(
    step_fn: StepFn, meter: Meter, search: MicroBatchSearch, micro: int, limit_bytes: int | None, say: Log
) -> Trial:
    predicted = search.predict(micro)
    if limit_bytes is not None and predicted is not None and predicted + search.margin_bytes() > limit_bytes:
        # CPU: the kernel's OOM killer would end the process instead of raising; never find out by trying.
        search.record(micro, None, fits=False)
        say(f"micro-batch {micro}: refused, predicted {format_bytes(predicted, 'MiB')} MiB > limit "
            f"{format_bytes(limit_bytes, 'MiB')} MiB")
        return Trial(micro, None, None, None, False, "refused", predicted)
    m, oom = guarded(lambda: meter.measure(lambda: step_fn(micro), micro_batch_size=micro))
    if oom:
        search.record(micro, None)
        say(f"micro-batch {micro}: out of memory")
        return Trial(micro, None, None, None, False, "out of memory", predicted)
    obs = search.record(micro, m.charged_bytes, baseline_bytes=m.baseline_bytes, rounding_bytes=m.rounding_bytes)
    status = "fits" if obs.fits else "over budget"
    # in MiB, the unit of the table printed after these lines; the seconds where the table shows them
    seconds = f", {m.seconds:.3f} s" if meter.times_steps else ""
    say(f"micro-batch {micro}: peak {format_bytes(m.peak_bytes, 'MiB')} MiB{seconds}, {status}")
    return Trial(micro, m.peak_bytes, m.reserved_bytes, m.seconds, obs.fits, status, predicted, m.baseline_bytes)


def _finish(result: ProbeResult, search: MicroBatchSearch) -> None:
    result.max_micro_batch_size = search.largest_fit
    result.fitted = search.line()
    result.next_size, result.next_verdict = search.next_over()


def _time_fitting_divisors(
    step_fn: StepFn,
    meter: Meter,
    search: MicroBatchSearch,
    result: ProbeResult,
    must_resolve: Sequence[int],
    say: Log,
) -> None:
    """Throughput mode: time every fitting size a plan can use and pick the one with the least time per optimizer
    step (`plan.choose_fastest`).

    A size not yet measured is measured first (memory grows with the micro-batch, so it should fit;
    the meter checks).  Times then come from two unmeasured runs, keeping the faster: a measured run
    pays for the profiler (CPU) or for refilling an emptied allocator cache (CUDA), and the first run at
    a new size pays for allocator growth, neither of which a steady training step has.
    """
    fitting = [d for d in must_resolve if d <= result.max_micro_batch_size]
    if not fitting:
        return
    measured = {t.micro_batch_size for t in result.trials if t.fits}
    rates: dict[int, float] = {}
    for d in fitting:
        if d not in measured:
            trial = _run_trial(step_fn, meter, search, d, None, say)
            result.trials.append(trial)
            if not trial.fits:
                continue
        seconds = min(meter.time(lambda d=d: step_fn(d), micro_batch_size=d) for _ in range(2))
        rates[d] = d / seconds
        say(f"micro-batch {d}: {rates[d]:.1f} samples/s")
    result.extra["samples_per_second"] = dict(rates)
    rates = agree_on_rates(rates)
    if rates:
        result.chosen_micro_batch_size = choose_fastest(rates, max(must_resolve), result.max_micro_batch_size)
    _finish(result, search)


# --- data parallel ----------------------------------------------------------------------------------------
def _dist_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def agree_max_micro_batch(local_max: int) -> int:
    """The smallest of every rank's largest fitting micro-batch (all-reduce MIN), so all ranks adopt one
    plan; ``local_max`` unchanged when torch.distributed is not initialized."""
    if not _distributed():
        return local_max
    import torch.distributed as dist

    t = torch.tensor([int(local_max)], dtype=torch.int64, device=_dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def agree_on_rates(rates: dict[int, float]) -> dict[int, float]:
    """Throughput across ranks: a data-parallel step lasts as long as its slowest rank, so each size's
    rate becomes the MIN over ranks; sizes some rank did not time are dropped."""
    if not _distributed():
        return rates
    import torch.distributed as dist

    sizes = list(range(1, max(rates, default=0) + 1))
    world_max = torch.tensor([len(sizes)], dtype=torch.int64, device=_dist_device())
    dist.all_reduce(world_max, op=dist.ReduceOp.MAX)
    n = int(world_max.item())
    t = torch.tensor([rates.get(i + 1, -1.0) for i in range(n)], dtype=torch.float64, device=_dist_device())
    present = (t > 0).to(torch.int64)
    dist.all_reduce(present, op=dist.ReduceOp.MIN)
    t = torch.where(present.bool(), t, torch.full_like(t, math.inf))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return {i + 1: float(t[i]) for i in range(n) if present[i]}


def _nothing_fits_message(result: ProbeResult) -> str:
    levels = result.extra.get("checkpointing")
    full = None if levels is None else levels["num_layers"]
    first = next((t for t in result.trials if t.micro_batch_size == 1 and t.checkpointed_layers in (None, full)
                  and t.status != "refused"), None)
    need = None if first is None else (first.reserved_bytes or first.peak_bytes)
    setting = result.extra.get("budget_setting")  # what gave the budget, so the message names what to raise
    budget = format_bytes(result.budget_bytes) + (f" ({setting})" if setting else "")
    amount = (
        f"needs {format_bytes(need)}, {format_bytes(need - result.budget_bytes)} over the budget of {budget}"
        if need
        else f"ran out of memory under the budget of {budget}"
    )
    on = result.extra.get("levers_on")  # the levers already in use are not suggested
    if levels is not None:
        return (
            f"even micro-batch 1 with every one of the {full} layers checkpointed does not fit: one training step "
            f"{amount}. What is left: " + fit_hints({**(on or {}), "checkpointing": True}, rest=(
                "shorten sequences (max_length / probe_seq_len)", "shard the model over more ranks (FSDP or "
                "DeepSpeed ZeRO)", "raise the memory budget")) + "."
        )
    return f"even micro-batch 1 does not fit: one training step {amount}. To fit: {fit_hints(on)}."
