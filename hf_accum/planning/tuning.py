"""What `Planner.tune()` does, in order: build the probe's inputs from the trainer, reuse the stored plan or probe,
plan, save the plan file and show the plan (its line at once, its figures through the Trainer's log).

measure (probe.py, meters.py) -> plan (plan.py) -> train (`Planner.apply`). Nothing here changes the trainer; the
plan is applied by the planner alone. The pieces it orchestrates live beside it: the scan of the data
(`data_scan.py`), the token budget's measurement (`tokens.py`), the plan line and figures (`probing/report.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from .. import levers
from ..compat import allocator, trainer_internals
from ..config.settings import Settings
from ..levers.kernels.fused_loss import loss_path
from ..probing.kernel_timing import candidates
from ..probing.loop import ProbeResult
from ..probing.meters import CpuMeter, CudaMeter, Meter
from ..probing.plan import Plan
from ..probing.probe import probe_model, resolve_budget
from ..probing.report import plan_figures, plan_line
from ..probing.seed import probe_with_estimate, trainer_reason
from ..window.units import detect_unit, make_cutter
from .data_scan import probe_batches, train_lengths
from .store import PLAN_FILE, PlanFileError, load_plan, plan_key, save_plan
from .token_kernels import measure_tokens

logger = logging.getLogger(__name__)


def default_meter(model: torch.nn.Module) -> Meter:
    device = next(model.parameters()).device
    return CudaMeter(device) if device.type == "cuda" else CpuMeter()


BUDGET_NAMES = ("memory_budget_bytes", "memory_budget")  # the arguments a budget message must name


@dataclasses.dataclass
class Prepared:
    """What the probe needs from the trainer, read before training: the budget, the batches at the worst-case
    length, the plan's key and the stored plan that key finds (None: probe)."""

    meter: Meter
    budget: int
    lengths: list[int] | None
    make_batch: Callable[[int], dict[str, Any]]
    seq_len: int
    key: dict[str, Any]
    stored: tuple[Plan, dict] | None


def prepare(trainer) -> Prepared:
    args = trainer.args
    _warn_unused_batch_settings(trainer)
    meter = default_meter(trainer.model)
    fraction = None if args.memory_budget_bytes is not None else args.memory_budget
    budget = resolve_budget(meter, args.memory_budget_bytes, fraction, names=BUDGET_NAMES)
    # one pass over the data for every length the probe and the plan need (none with probe_seq_len, but in "tokens"
    # mode, whose expected cuts are computed on the data)
    own = trainer._adapter.probe_batches(trainer)  # GRPO: its generated batches at the longest prompt + completion
    lengths = None if own else train_lengths(trainer) if args.probe_seq_len is None or args.micro_batching == "tokens" \
        else None
    make_batch, seq_len = own or probe_batches(trainer, lengths=lengths)
    device = str(meter.describe().get("device", meter.name))
    key = plan_key(trainer, seq_len=seq_len, capacity_bytes=meter.capacity_bytes(), device=device)
    stored = agreed_stored(_stored_plan(args.output_dir, key), trainer._collective())
    return Prepared(meter, budget, lengths, make_batch, seq_len, key, stored)


Probe = Callable[..., tuple[ProbeResult, Plan]]  # probe(make_batch, length, max_micro=..., seed=...) -> (result, plan)


def tune(trainer, prepared: Prepared | None = None, probe: Probe | None = None, *,
         store: bool = True) -> tuple[Plan, ProbeResult | None, dict[str, Any]]:
    """Returns the plan, what the probe measured (None when the stored plan was reused) and the plan's key.
    ``probe``: how to measure one length (default: `probe_model` on the unwrapped model, before training; under
    DeepSpeed, `probing.engine.probe_through_engine` inside the loop, whose figures are logged at once). ``store``:
    False where the caller saves the plan itself (`hf-accum probe RECIPE`)."""
    args = trainer.args
    prepared = prepared or prepare(trainer)
    in_loop = probe is not None
    if prepared.stored is not None:
        plan, record = prepared.stored
        figures = plan_figures(plan, prepared.budget, record.get("probe"), reused=True)
        _show("%s (reused %s: nothing that changes memory changed)", args, plan_line(plan, figures, loss_path(trainer)),
              os.path.join(args.output_dir, PLAN_FILE))
        _log_in_trainer(trainer, figures)
        return plan, None, prepared.key

    if args.device.type == "cuda":  # the probe measures under the allocator training uses: say which
        _show("%s", args, allocator.line(allocator.OUTCOME))
    if in_loop:
        levers.searched(trainer)  # through the engine no level is chosen: the lever's one log line says so
    probe = probe or _model_probe(trainer, prepared)
    if args.micro_batching == "tokens":  # the budget measured under each loss kernel, compared by whole steps
        kernels = [] if in_loop else candidates(trainer.model, prepared.meter, bool(args.bf16 or args.fp16))
        plan, result = measure_tokens(trainer, probe, prepared, kernels)
    else:
        result, plan = probe(prepared.make_batch, prepared.seq_len)
    pinned = levers.pinned_records(trainer.model, args)  # a level the user set is recorded as such
    if pinned:
        plan = dataclasses.replace(plan, levers={**pinned, **(plan.levers or {})})
    figures = plan_figures(plan, prepared.budget, result.to_dict(), reused=False)
    where = ""
    if args.should_save and store:
        where = f" (details: {save_plan(args.output_dir, prepared.key, plan, result.to_dict())})"
    _show("%s%s", args, plan_line(plan, figures, loss_path(trainer)), where)
    _log_in_trainer(trainer, figures)
    return plan, result, prepared.key


def _model_probe(trainer, prepared: Prepared) -> Probe:
    """`probe_model` on the trainer's model, optimizer and loss, before training."""
    args = trainer.args
    levers.apply_requested(trainer.model, args)  # as train() will, so the probe measures it
    lever = levers.searched(trainer)  # "auto": the first probe chooses a level; later lengths are probed at it
    chosen: list[int] = []
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, trainer.model)
    autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    unseeded = trainer_reason(trainer) if args.probe_from_estimate else "probe_from_estimate=False"
    if unseeded is not None and args.probe_from_estimate:
        logger.info("estimate skipped (%s): the search starts from micro-batch 1", unseeded)

    def probe(make, length, max_micro=args.probe_max_micro_batch, seed=None):
        """``seed``: the search's start (another loss kernel's rows at this length), instead of the estimate."""
        if lever is None:
            return measure(make, length, max_micro, None, seed)
        if not chosen:
            result, plan = measure(make, length, max_micro, lever, seed)
            chosen.append(result.extra["checkpointing"]["chosen_k"])
            return result, plan
        with lever.at(chosen[0]):
            return measure(make, length, max_micro, None, seed)

    def measure(make, length, max_micro, lever, seed):
        seeded = {} if seed is None else {"seeder": lambda budget, meter: (seed, None)}
        return (probe_model if unseeded or seeded else probe_with_estimate)(
            trainer.model,
            seq_len=length,
            target_batch_size=args.target_batch_size,
            world_size=args.world_size,
            budget_bytes=prepared.budget,
            budget_names=BUDGET_NAMES,
            make_batch=make,
            optimizer_cls=optimizer_cls,
            optimizer_kwargs=optimizer_kwargs,
            optimizer=trainer.optimizer,
            forward=lambda model, batch: _probe_forward(trainer, model, batch),
            autocast_dtype=autocast,
            max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
            meter=prepared.meter,
            max_micro_batch=max_micro,
            optimize=args.auto_tune_optimize,
            log=lambda line: _show("hf_accum probe: %s", args, line),  # each trial a line, seen without any setup
            lever=lever,
            timed_rows=args.micro_batching == "tokens",  # the token cut's step-time model (planning/tokens.py)
            collective=trainer._collective() if trainer.engine.probe_runs_collectives else None,
            **seeded,
        )

    return probe


def _probe_forward(trainer, model, batch) -> torch.Tensor:
    """One probe step's loss, as a training forward computes it: a window of one forward (its micro-batch), its own
    count as ``num_items_in_batch``, through the trainer's adapter (GRPO: TRL's loss as the forward's own mean)."""
    items = _items(trainer, batch)
    batch, context = trainer._adapter.chunk(trainer, batch, items if items is not None else 1)
    with trainer_internals.one_forward_window(trainer), context:
        return trainer.compute_loss(model, batch, num_items_in_batch=items)


def _items(trainer, batch) -> torch.Tensor | None:
    """What a training forward passes as ``num_items_in_batch`` (its own counted labels, as `_chunk_step` does), so a
    ``compute_loss_func`` that divides by it runs in the probe as in training."""
    mode = Settings(trainer.args).loss_normalization or "tokens"
    if mode == "model":
        return None
    return make_cutter(trainer.batch_unit or detect_unit(batch), trainer._label_spec()).count(batch, mode).clamp(min=1)


def _stored_plan(output_dir: str, key: dict[str, Any]):
    """The reusable stored plan, or None. A plan file that cannot be trusted is named, then probed over."""
    try:
        return load_plan(output_dir, key)
    except PlanFileError as exc:
        logger.warning("hf_accum: ignoring the stored plan: %s. Probing again; the file will be rewritten.", exc)
        return None


def agreed_stored(stored, collective):
    """The stored plan if every rank found the same one, else None on every rank. Ranks can see different plan files
    (an output_dir per rank or per node, a rank that never saved one): were some to reuse while others probe, the
    probers would wait forever in the probe's collectives. One exchange (MAX of the digest and of its negation)."""
    if collective.world == 1:
        return stored
    digest = _digest(stored[0]) if stored is not None else 0
    top, neg_bottom = collective.max_of((digest, -digest))
    if digest and top == -neg_bottom == digest:
        return stored
    if stored is not None:
        logger.warning("hf_accum: the stored plan is not reused: %s. Probing again on every rank.",
                       "another rank found none" if -neg_bottom == 0 else "another rank found a different one")
    return None


def _digest(plan: Plan) -> int:
    """A plan as a positive 62-bit integer, equal on two ranks when their plans are."""
    text = json.dumps(plan.to_dict(), sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2 or 1


# --- what the user sees (the line and figures themselves: probing/report.py) --------------------------------
def _show(message: str, args, *values) -> None:
    """Once per run at warning level, so it is seen without any logging setup (other ranks: info)."""
    (logger.warning if args.should_log else logger.info)(message, *values)


def _log_in_trainer(trainer, figures: dict[str, float]) -> None:
    """The figures go with the run's first log entry (`AccumulationMixin.log`): recorded in `log_history` and by the
    `report_to` integrations, without an entry of their own that would move the Trainer's own ones. A second tune()
    replaces the figures of the first."""
    trainer.planner.figures = dict(figures)


def _warn_unused_batch_settings(trainer) -> None:
    """The per_device_train_batch_size / gradient_accumulation_steps the user set, which the plan replaces: harmless
    (they multiply to the target, or give a micro-batch alone; `AccumTrainingArguments` refuses an accumulation that
    contradicts the target), but never dropped without a word."""
    given = getattr(trainer, "_given_batch", None) or {}
    if not given:
        return
    settings = " and ".join(f"{k}={v}" for k, v in given.items())
    cap = given.get("per_device_train_batch_size")
    logger.warning(
        "hf_accum: auto_tune plans the micro-batch and accumulation for target_batch_size=%d, so %s %s not used "
        "(the effective batch is the target either way).%s Set auto_tune=False to use them as given.",
        trainer.args.target_batch_size, settings, "is" if len(given) == 1 else "are",
        f" To cap the micro-batch, set probe_max_micro_batch={cap}." if cap else "",
    )
