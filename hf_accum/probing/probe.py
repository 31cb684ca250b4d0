"""Probe a model and plan its target batch: `probe_model`, for the trainer and the CLI, builds the step of a model,
an optimizer and a batch factory (`make_step_fn`), runs the probe loop (`loop.py`) or, with a lever, the
level search (`levels.py`) inside `preserve.preserved` (save -> try -> restore), and returns what was
measured and the exact plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..compat import bitsandbytes_cpu
from ..config.fit_hints import levers_on
from ..window.protocol import Collective
from .agreed import in_lockstep
from .kernel_timing import measure_kernels
from .levels import probe_levels
from .loop import (
    DEFAULT_BUDGET_FRACTION,
    Log,
    MakeBatch,
    NothingFitsError,
    ProbeResult,
    StepFn,
    _nothing_fits_message,
    agree_max_micro_batch,
    probe_micro_batches,
)
from .meters import CpuMeter, CudaMeter, Meter, format_bytes, live_tensor_bytes
from .plan import Plan, forward_breakpoints, indivisible_target, plan_batch, plan_for_micro
from .preserve import fresh_optimizer_like, preserved
from .step_timing import time_rows

# (budget, meter) -> (seed, record); the seed: an int (the micro-batch search's), or with a lever a dict of its
# positions' seeds (the level search's anchors)
Seeder = Callable[[int, Meter], tuple[int | dict[int, int] | None, dict[str, Any] | None]]


# --- the step -----------------------------------------------------------------------------------------------
def _default_forward(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss


def make_step_fn(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    make_batch: MakeBatch,
    *,
    forward: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
) -> StepFn:
    """``step_fn(micro)``: one real training step at that micro-batch size.

    ``make_batch(micro)`` returns the collated batch, on the model's device, every sequence at the
    worst-case length.  ``forward(model, batch)`` returns the loss (default: ``model(**batch).loss``);
    a trainer passes its ``compute_loss``.  The gradients are zeroed, not freed, after the step: during
    an accumulation window every micro-step but the first starts with all gradients allocated, which is
    the peak to plan for.

    ``step_fn(micro, forwards=n)``: the same ``micro`` rows cut into ``n`` near-equal forwards, their gradients
    accumulated, one optimizer step (benchmarks/bench_token_budget.py part 4 times it). ``step_fn(0)``: the
    optimizer's step alone, on the zeroed gradients a step leaves (a token budget's step-time model subtracts it
    from every forward's step: `step_timing.py`).
    """
    fwd = forward or _default_forward
    device_type = next(model.parameters()).device.type

    def step_fn(micro: int, forwards: int = 1) -> None:
        model.train()
        for rows in _near_equal(micro, forwards) if micro else ():
            batch = make_batch(rows)
            ctx = (
                torch.autocast(device_type=device_type, dtype=autocast_dtype)
                if autocast_dtype is not None
                else contextlib.nullcontext()
            )
            with ctx:
                # the losses are not scaled by 1/forwards: only the time of this step is read, not its gradient
                loss = fwd(model, batch)
            loss.backward()
            del loss, batch
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step_fn


def _near_equal(rows: int, parts: int) -> list[int]:
    """``rows`` cut into ``parts`` sizes differing by at most one, the larger first (5 in 2: 3 + 2)."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def random_token_batch(model: torch.nn.Module, seq_len: int) -> MakeBatch:
    """``make_batch`` for a causal LM: random ids, every position a label but one. With two rows or more, the last
    row's last position is padding: batches of mixed lengths carry a padding mask, which can cost more memory than
    its tokens (SDPA then builds masked scores), and a single pad token leaves every per-token cost as it was."""
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device

    def make_batch(micro: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (micro, seq_len), device=device)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        if micro > 1 and seq_len > 1:
            mask[-1, -1] = 0
            labels[-1, -1] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make_batch


# --- the entry point for the trainer and the CLI -------------------------------------------------------------
def resolve_budget(
    meter: Meter,
    budget_bytes: int | None,
    budget_fraction: float | None,
    *,
    names: tuple[str, str] = ("budget_bytes", "budget_fraction"),
) -> int:
    """The budget in bytes from exactly one of bytes / fraction. A fraction is of the memory this process can
    use now (capacity minus what other processes hold), so the default keeps a margin on a shared device
    instead of refusing to start. ``names``: how the caller's user spells the two (messages name them)."""
    bytes_name, fraction_name = names
    capacity = meter.capacity_bytes()
    usable = capacity - meter.unavailable_bytes()
    held = f"{format_bytes(capacity)} capacity minus {format_bytes(capacity - usable)} held by other processes or outside torch"
    if budget_bytes is not None and budget_fraction is not None:
        raise ValueError(f"give either {bytes_name} or {fraction_name}, not both")
    if budget_bytes is None:
        fraction = DEFAULT_BUDGET_FRACTION if budget_fraction is None else budget_fraction
        if not 0 < fraction <= 1:
            raise ValueError(f"{fraction_name}={fraction} must be in (0, 1]: a fraction of the memory this process "
                             f"can use on {meter.name} ({format_bytes(usable)} now)")
        budget_bytes = int(fraction * usable)
        if budget_bytes <= 0:
            raise ValueError(f"{fraction_name}={fraction} leaves no memory on {meter.name}: {held}. Free memory "
                             "held by other processes.")
        return budget_bytes
    if budget_bytes <= 0:
        raise ValueError(f"{bytes_name}={budget_bytes} must be positive (the device has {format_bytes(capacity)})")
    if budget_bytes > usable:
        raise ValueError(
            f"{bytes_name}={budget_bytes} ({format_bytes(budget_bytes)}) exceeds what this process can use on {meter.name} "
            f"now: {held}. Set {fraction_name} instead (a fraction of the memory usable when the probe starts, "
            f"e.g. 0.9), or free memory held by other processes."
        )
    return int(budget_bytes)


def probe_model(
    model: torch.nn.Module,
    *,
    seq_len: int,
    target_batch_size: int,
    world_size: int = 1,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    budget_names: tuple[str, str] = ("budget_bytes", "budget_fraction"),
    make_batch: MakeBatch | None = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
    optimizer_kwargs: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    forward: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
    meter: Meter | None = None,
    max_micro_batch: int | None = None,
    optimize: str = "memory",
    log: Log | None = None,
    lever: Any = None,
    seeder: Seeder | None = None,
    timed_rows: bool = False,
    after: Callable[[ProbeResult, StepFn], None] | None = None,
    collective: Collective | None = None,
) -> tuple[ProbeResult, Plan]:
    """Probe ``model`` and plan ``target_batch_size``: returns what was measured and the exact plan.

    ``lever`` (`levers.base.Levels` of a registered lever: ``count``, ``anchors``, ``at(position)``, ``record``): also
    choose its level (:func:`probe_levels`); the plan then records it, and the caller applies it.
    ``seeder(budget_bytes, meter)``: ``(seed, record)``, an estimate of the largest fit to start the search from and
    what to record of it in ``result.extra["estimate"]`` (`seed.py`; with a lever, a seed per anchor position).
    ``timed_rows``: also time plain steps of one forward from the largest fit down to one row, halving
    (``result.extra["step_times"]``), and the optimizer's step alone (``result.extra["optimizer_step_seconds"]``), a
    token budget's step-time model: `step_timing.py`.
    ``after(result, step_fn)``: called last, while the probe's optimizer is still warm (the estimate's further sizes
    step on it instead of warming another: `estimate.every_peak`).
    ``collective``: the ranks, where each probe step runs collectives (a model sharded in place: FSDP2): every rank
    then runs the same trials, reading the largest measurement over the ranks under the smallest budget
    (`agreed.in_lockstep`); without it each rank searches on its own figures.

    The probe steps a fresh optimizer (``optimizer_cls(trainable params, **optimizer_kwargs)``, or one
    like ``optimizer`` if given, whose own state is never touched) and leaves the model, its gradients
    and the RNG as they were.  Every rank of a data-parallel run calls this; all adopt the smallest
    rank's maximum, so the plans agree.  Raises ``ValueError`` before any step for bad input and
    :class:`NothingFitsError` when micro-batch 1 exceeds the budget.
    """
    per_rank, cap = _checked_window(model, seq_len, target_batch_size, world_size, max_micro_batch)
    with stepping(model, make_batch=make_batch or random_token_batch(model, seq_len), optimizer_cls=optimizer_cls,
                  optimizer_kwargs=optimizer_kwargs, optimizer=optimizer, forward=forward,
                  autocast_dtype=autocast_dtype, max_grad_norm=max_grad_norm, meter=meter) as (step_fn, meter):
        budget = resolve_budget(meter, budget_bytes, budget_fraction, names=budget_names)
        if collective is not None and collective.world > 1:
            meter, budget = in_lockstep(meter, collective, budget, " or ".join(budget_names))
        seed, estimated = seeder(budget, meter) if seeder is not None else (None, None)
        result = _search(step_fn, meter, budget, cap, per_rank, optimize=optimize, log=log, lever=lever, seed=seed)
        # the levers in use before the plan is made: "nothing fits" suggests only those that are off
        result.extra.update(seq_len=seq_len, levers_on=levers_on(model), **({} if estimated is None else
                                                                            {"estimate": estimated}))
        result.extra["budget_setting"] = _budget_setting(budget_bytes, budget_fraction, budget_names)
        plan = _with_level(plan_from_result(result, target_batch_size, world_size), result)
        plan = _with_kernel(plan, result, model, step_fn, meter, budget, lever, autocast_dtype is not None, log)
        if timed_rows:
            result.extra["step_times"], result.extra["optimizer_step_seconds"] = time_rows(
                result, step_fn, meter, lever, model)
        if after is not None:
            after(result, step_fn)
    return result, plan


def _budget_setting(budget_bytes: int | None, budget_fraction: float | None, names: tuple[str, str]) -> str:
    """The setting that gave the budget, as the user spells it: a "nothing fits" message names what to raise."""
    if budget_bytes is not None:
        return f"{names[0]}={budget_bytes}: raise it, or unset it for {DEFAULT_BUDGET_FRACTION:.0%} of the device"
    fraction = DEFAULT_BUDGET_FRACTION if budget_fraction is None else budget_fraction
    return f"{names[1]}={fraction}" + ("" if fraction >= 1 else ": raise it up to 1")


@contextlib.contextmanager
def stepping(model: torch.nn.Module, *, make_batch: MakeBatch,
             optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
             optimizer_kwargs: dict[str, Any] | None = None, optimizer: torch.optim.Optimizer | None = None,
             forward: Callable[[torch.nn.Module, dict[str, Any]], torch.Tensor] | None = None,
             autocast_dtype: torch.dtype | None = None, max_grad_norm: float | None = None,
             meter: Meter | None = None):
    """The probe's step of ``model`` and its meter, ``(step_fn, meter)``, for as long as the block runs: a fresh
    optimizer (see `probe_model`), the model, its gradients and the RNG restored after."""
    bitsandbytes_cpu.keep_unpacked(model)  # a 4-bit layer packed by an eval-mode forward on CPU drops gradients
    with preserved(model):
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters (requires_grad=False everywhere)")
        opt = fresh_optimizer_like(optimizer) if optimizer is not None else optimizer_cls(trainable,
                                                                                           **(optimizer_kwargs or {}))
        try:
            yield make_step_fn(model, opt, make_batch, forward=forward, autocast_dtype=autocast_dtype,
                               max_grad_norm=max_grad_norm), _meter_for(model, opt, meter)
        finally:
            opt.state.clear()  # the probe's optimizer state goes now, not whenever the closures die


def _with_kernel(plan: Plan, result: ProbeResult, model, step_fn: StepFn, meter: Meter, budget: int, lever: Any,
                 autocast: bool, log: Log | None) -> Plan:
    """The plan, recording the loss kernel timed fastest at its micro-batch (and the level a level search chose)."""
    with contextlib.nullcontext() if lever is None else lever.at(result.extra["checkpointing"]["chosen_k"]):
        kernel = measure_kernels(model, step_fn, meter, budget, plan.micro_batch_size, autocast, log)
    if kernel is None:
        return plan
    result.extra["loss_kernel"] = kernel
    return dataclasses.replace(plan, levers={**(plan.levers or {}), "loss_kernel": kernel})


def _with_level(plan: Plan, result: ProbeResult) -> Plan:
    """The plan, recording the lever level the level search chose (if it ran)."""
    chosen = result.extra.get("checkpointing")
    if chosen is None:
        return plan
    return dataclasses.replace(plan, levers={**(plan.levers or {}), chosen["lever"]: chosen["plan_record"]},
                               step_seconds=chosen.get("step_seconds"))


def seq_len_problem(model: torch.nn.Module, seq_len: int, setting: str = "probe_seq_len") -> str | None:
    """Why ``model`` cannot be probed at ``seq_len`` (longer than its positions), naming ``setting``, the
    setting that gave it (`hf-accum probe` passes its flag); None when it can."""
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        return (f"probe seq_len={seq_len} exceeds the model's max_position_embeddings={max_positions}; "
                f"set {setting} <= {max_positions}")
    return None


def _checked_window(model: torch.nn.Module, seq_len: int, target_batch_size: int, world_size: int,
                    max_micro_batch: int | None) -> tuple[int, int]:
    """Cheap checks first: no step runs on input that cannot give a plan. Returns (per-rank window, cap)."""
    if target_batch_size < 1 or world_size < 1:
        raise ValueError(f"target_batch_size={target_batch_size} and world_size={world_size} must be >= 1")
    problem = indivisible_target(target_batch_size, world_size)
    if problem:
        raise ValueError(f"{problem}.")
    problem = seq_len_problem(model, seq_len)
    if problem:
        raise ValueError(problem)
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    per_rank = target_batch_size // world_size
    cap = per_rank if max_micro_batch is None else min(per_rank, max_micro_batch)
    if cap < 1:
        raise ValueError(f"max_micro_batch={max_micro_batch} must be >= 1")
    return per_rank, cap


def _meter_for(model: torch.nn.Module, opt: torch.optim.Optimizer, meter: Meter | None) -> Meter:
    """The meter given, else CUDA's on a CUDA model; a CPU meter counts the live tensors the profiler cannot see."""
    if meter is None and next(model.parameters()).device.type == "cuda":
        meter = CudaMeter(next(model.parameters()).device)
    if meter is None or (isinstance(meter, CpuMeter) and meter.resident is None):
        meter = CpuMeter(resident=lambda: live_tensor_bytes(model, opt))
    return meter


def _search(step_fn: StepFn, meter: Meter, budget: int, cap: int, per_rank: int, *, optimize: str, log: Log | None,
            lever: Any, seed: int | dict[int, int] | None = None) -> ProbeResult:
    """The micro-batch search (from ``seed`` when given), or with ``lever`` the search across its levels (each
    anchor from its seed when ``seed`` is a dict)."""
    if lever is None:
        return probe_micro_batches(step_fn, meter, budget, cap, must_resolve=forward_breakpoints(per_rank),
                                   optimize=optimize, log=log, seed=seed if isinstance(seed, int) else None)
    if optimize == "throughput" and log is not None:  # said, not silently dropped
        log("auto_tune_optimize='throughput': the checkpointing lever already chooses rows and layers by "
            "measured step time; no separate timing of every size")
    return probe_levels(step_fn, meter, budget, cap, per_rank, lever, must_resolve=forward_breakpoints(per_rank),
                        log=log, seeds=seed if isinstance(seed, dict) else None)


def plan_from_result(result: ProbeResult, target_batch_size: int, world_size: int) -> Plan:
    """The exact plan from what the probe measured, every rank adopting the smallest rank's maximum; raises
    :class:`NothingFitsError` when micro-batch 1 did not fit."""
    result.extra.update({"target_batch_size": target_batch_size, "world_size": world_size})
    agreed = agree_max_micro_batch(result.max_micro_batch_size)
    if agreed != result.max_micro_batch_size:
        result.extra["local_max_micro_batch_size"] = result.max_micro_batch_size
        result.max_micro_batch_size = agreed
    if result.max_micro_batch_size < 1:
        raise NothingFitsError(_nothing_fits_message(result), result)
    plan = plan_batch(target_batch_size, world_size, result.max_micro_batch_size)
    if result.optimize == "throughput" and result.chosen_micro_batch_size:
        plan = plan_for_micro(target_batch_size, world_size, min(result.chosen_micro_batch_size, plan.micro_batch_size))
    return plan
