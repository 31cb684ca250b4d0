"""The eval batch, planned: the largest evaluation batch whose measured step fits the memory budget.

Measured at the first evaluation, when what training leaves resident (weights, optimizer state) is really there:
a real `prediction_step` on copies of the longest evaluation example, holding what the Trainer holds per batch
(the logits when `compute_metrics` needs them). The largest fitting size is found by doubling then bisection
(peak memory grows with the batch). With logits kept, `eval_accumulation_steps` moves the gathered predictions to
the CPU before the batches held add up past the budget. ``eval_loss`` does not depend on the size chosen
(evaluation.py), so the size is free to follow memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..config.settings import Settings
from ..probing.meters import CpuMeter, format_bytes, live_tensor_bytes
from ..probing.preserve import modes_and_rng_preserved
from ..probing.probe import resolve_budget
from ..window.oom import guarded
from ..window.protocol import Local, TorchDistributed
from . import tuning
from .data_scan import longest_index, row_length

logger = logging.getLogger(__name__)


def largest_fitting(fits: Callable[[int], bool], upper: int) -> tuple[int, list[tuple[int, bool]]]:
    """The largest ``b`` in ``[1, upper]`` with ``fits(b)`` (0 when 1 does not fit), for a monotone ``fits``:
    doubling from 1, then bisection between the last fit and the first failure. Returns it and the trials."""
    trials: list[tuple[int, bool]] = []

    def check(b: int) -> bool:
        trials.append((b, fits(b)))
        return trials[-1][1]

    if upper < 1 or not check(1):
        return 0, trials
    lo, hi = 1, None
    while hi is None:
        nxt = min(lo * 2, upper)
        if nxt == lo:
            return lo, trials
        if check(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if check(mid) else (lo, mid)
    return lo, trials


def accumulation_steps(budget_bytes: int, step_peak_bytes: int, kept_bytes_per_batch: int) -> int | None:
    """Batches whose kept predictions fit beside one step's peak (None: nothing kept, no limit needed)."""
    if kept_bytes_per_batch <= 0:
        return None
    return max(1, (budget_bytes - step_peak_bytes) // kept_bytes_per_batch)


@dataclasses.dataclass
class EvalBatchChoice:
    batch_size: int
    accumulation_steps: int | None
    peak_bytes: int
    trials: list[tuple[int, bool]]


def choose_eval_batch(run: Callable[[dict], Any], make_batch: Callable[[int], dict], meter, budget_bytes: int,
                      upper: int) -> EvalBatchChoice:
    """Measure ``run(make_batch(b))`` (one prediction_step, its outputs held as the loop holds them) and pick."""
    peaks: dict[int, int] = {}
    kept: dict[int, int] = {}

    def fits(b: int) -> bool:
        batch = make_batch(b)
        held: list = []
        m, failed = guarded(lambda: meter.measure(lambda: held.append(run(batch)), micro_batch_size=b))
        if failed:
            return False
        peaks[b] = m.charged_bytes + m.rounding_bytes
        kept[b] = _nbytes(held[0][1:] if held and isinstance(held[0], tuple) else None)
        held.clear()
        return peaks[b] <= budget_bytes

    best, trials = largest_fitting(fits, upper)
    if best == 0:
        return EvalBatchChoice(0, None, 0, trials)
    return EvalBatchChoice(best, accumulation_steps(budget_bytes, peaks[best], kept[best]), peaks[best], trials)


def _nbytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def plan_eval_batch(trainer, dataset, *, budget: int | None, run) -> EvalBatchChoice | None:
    """Measure and choose for ``trainer`` on ``dataset`` (None: its eval_dataset; a name: that one of them; a dict:
    its first); every rank
    measures and all take the smallest choice. ``run(model, batch, loss_only)`` is the Trainer's prediction_step.
    None (logged) when there is nothing to measure, the eval loader has no ``.dataset`` or not even one example
    fits."""
    args = trainer.args
    dataset = trainer.eval_dataset if dataset is None else trainer.eval_dataset[dataset] if isinstance(dataset, str) \
        else dataset
    if isinstance(dataset, dict):
        dataset = next(iter(dataset.values()), None)
    if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    loader = trainer.get_eval_dataloader(dataset)
    if not hasattr(loader, "dataset"):  # a trainer's own loader: its batches are its own, whatever size is chosen
        logger.warning("hf_accum: get_eval_dataloader() returned a %s without .dataset, so its examples and batch "
                       "size are its own; the eval batch is not planned (per_device_eval_batch_size stays %d)",
                       type(loader).__name__, args.per_device_eval_batch_size)
        return None
    base = loader.dataset
    length = row_length(trainer)  # a preference pair: prompt + the longer completion, as its collator builds it
    example = base[longest_index([length(base[i]) for i in range(len(base))])]
    collate = loader.collate_fn
    model = trainer.model
    meter = tuning.default_meter(model)
    if isinstance(meter, CpuMeter):  # the profiler sees no tensor allocated before the step: count those too
        meter = CpuMeter(resident=lambda: live_tensor_bytes(model, trainer.optimizer))
    if budget is None:
        fraction = None if Settings(args).memory_budget_bytes is not None else Settings(args).memory_budget
        budget = resolve_budget(meter, Settings(args).memory_budget_bytes, fraction,
                                names=tuning.BUDGET_NAMES)
    loss_only = trainer.compute_metrics is None or args.prediction_loss_only  # what evaluate() asks for
    world = trainer.accelerator.num_processes
    upper = math.ceil(len(base) / world)
    with torch.no_grad(), modes_and_rng_preserved(model):
        model.eval()
        choice = choose_eval_batch(lambda batch: run(model, batch, loss_only), lambda b: collate([example] * b),
                                   meter, budget, upper)
    collective = TorchDistributed(world, args.device) if world > 1 else Local()
    agreed = -collective.max_of((-choice.batch_size,))[0]
    if agreed == 0:
        logger.warning("hf_accum: an evaluation step of one copy of the longest eval example does not fit the memory "
                       "budget (%d bytes); per_device_eval_batch_size stays %d", budget,
                       args.per_device_eval_batch_size)
        return None
    if agreed != choice.batch_size:
        choice = dataclasses.replace(choice, batch_size=agreed)
    given = args.per_device_eval_batch_size
    held = "loss only" if loss_only else "generating to full length, its tokens kept" if getattr(
        args, "predict_with_generate", False) else "logits kept"
    logger.warning("hf_accum: eval batch %d per rank: the largest whose measured evaluation step (the longest eval "
                   "example, %s) fits the budget of %s (peak %s, %d trials)%s%s", choice.batch_size,
                   held, format_bytes(budget), format_bytes(choice.peak_bytes),
                   len(choice.trials),
                   "" if choice.accumulation_steps is None else
                   f"; eval_accumulation_steps {choice.accumulation_steps} unless set",
                   "" if given == choice.batch_size else
                   f"; it replaces per_device_eval_batch_size={given} (auto_eval_batch_size=False keeps the value "
                   "given)")
    return choice
