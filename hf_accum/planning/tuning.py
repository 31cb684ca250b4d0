"""What `Planner.tune()` does: build the probe's inputs from the trainer, probe or reuse, plan.

measure (probe.py, meters.py) -> plan (plan.py) -> train (`Planner.apply`). Nothing here changes the trainer;
the plan is applied by the planner alone.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from .. import allocator, checkpointing
from ..compat import trainer_internals
from ..estimating.seed import probe_with_estimate
from ..loss import loss_shifts_labels
from ..meters import CpuMeter, CudaMeter, Meter
from ..probe import probe_model, random_token_batch, resolve_budget
from ..probe_loop import ProbeResult
from ..settings import Settings
from ..token_budget import TokenBudget, cost_model, predicted_peak
from ..units import detect_unit, make_cutter
from .plan import Plan
from .store import PLAN_FILE, PlanFileError, load_plan, plan_key, save_plan

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
    lengths = _train_lengths(trainer) if args.probe_seq_len is None or args.micro_batching == "tokens" else None
    make_batch, seq_len = probe_batches(trainer, lengths=lengths)
    device = str(meter.describe().get("device", meter.name))
    key = plan_key(trainer, seq_len=seq_len, capacity_bytes=meter.capacity_bytes(), device=device)
    return Prepared(meter, budget, lengths, make_batch, seq_len, key, _stored_plan(args.output_dir, key))


Probe = Callable[..., tuple[ProbeResult, Plan]]  # probe(make_batch, length, max_micro=...) -> (result, plan)


def tune(trainer, prepared: Prepared | None = None, probe: Probe | None = None, *,
         store: bool = True) -> tuple[Plan, ProbeResult | None, dict[str, Any]]:
    """Returns the plan, what the probe measured (None when the stored plan was reused) and the plan's key.
    ``probe``: how to measure one length (default: `probe_model` on the unwrapped model, before training; under
    DeepSpeed, `engine_probe.probe_through_engine` inside the loop, whose figures are logged at once). ``store``:
    False where the caller saves the plan itself (`hf-accum probe RECIPE`)."""
    args = trainer.args
    prepared = prepared or prepare(trainer)
    in_loop = probe is not None
    if prepared.stored is not None:
        plan, record = prepared.stored
        figures = plan_figures(plan, prepared.budget, record.get("probe"), reused=True)
        _show("%s (reused %s: nothing that changes memory changed)", args, plan_line(plan, figures),
              os.path.join(args.output_dir, PLAN_FILE))
        _log_in_trainer(trainer, figures, in_loop)
        return plan, None, prepared.key

    if args.device.type == "cuda":  # the probe measures under the allocator training uses: say which
        _show("%s", args, allocator.line(allocator.OUTCOME))
    if in_loop:
        checkpointing.lever_for(trainer)  # through the engine k is not chosen: its one log line says so
    probe = probe or _model_probe(trainer, prepared)
    result, plan = probe(prepared.make_batch, prepared.seq_len)
    if args.micro_batching == "tokens":
        chosen = plan
        plan, result = token_plan(trainer, plan, result, prepared.seq_len, probe, prepared.lengths)
        plan = dataclasses.replace(plan, checkpointed_layers=chosen.checkpointed_layers, num_layers=chosen.num_layers,
                                   step_seconds=chosen.step_seconds)
    figures = plan_figures(plan, prepared.budget, result.to_dict(), reused=False)
    where = ""
    if args.should_save and store:
        where = f" (details: {save_plan(args.output_dir, prepared.key, plan, result.to_dict())})"
    _show("%s%s", args, plan_line(plan, figures), where)
    _log_in_trainer(trainer, figures, in_loop)
    return plan, result, prepared.key


def _model_probe(trainer, prepared: Prepared) -> Probe:
    """`probe_model` on the trainer's model, optimizer and loss, before training."""
    args = trainer.args
    checkpointing.apply_requested(trainer.model, args)  # as train() will, so the probe measures it
    lever = checkpointing.lever_for(trainer)  # "auto": the first probe chooses k; later lengths are probed at it
    chosen: list[int] = []
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, trainer.model)
    autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None

    def probe(make, length, max_micro=args.probe_max_micro_batch):
        if lever is None:
            return measure(make, length, max_micro, None)
        if not chosen:
            result, plan = measure(make, length, max_micro, lever)
            chosen.append(plan.checkpointed_layers)
            return result, plan
        with lever.at(chosen[0]):
            return measure(make, length, max_micro, None)

    def measure(make, length, max_micro, lever):
        return (probe_with_estimate if args.probe_from_estimate else probe_model)(
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
            forward=lambda model, batch: trainer.compute_loss(model, batch, num_items_in_batch=_items(trainer, batch)),
            autocast_dtype=autocast,
            max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
            meter=prepared.meter,
            max_micro_batch=max_micro,
            optimize=args.auto_tune_optimize,
            log=logger.info,
            lever=lever,
        )

    return probe


def _items(trainer, batch) -> torch.Tensor | None:
    """What a training forward passes as ``num_items_in_batch`` (its own counted labels, as `_chunk_step` does), so a
    ``compute_loss_func`` that divides by it runs in the probe as in training."""
    mode = Settings(trainer.args).loss_normalization or "tokens"
    if mode == "model":
        return None
    return make_cutter(trainer.batch_unit or detect_unit(batch), trainer._label_spec()).count(batch, mode).clamp(min=1)


def token_plan(trainer, plan: Plan, result: ProbeResult, seq_len: int, probe,
               lengths: list[int] | None) -> tuple[Plan, ProbeResult]:
    """``micro_batching="tokens"``: the most tokens one forward may hold, measured, not extrapolated.

    For a fixed token count, a step's peak is convex in the padded length (per-row terms fall, attention's
    quadratic term grows), so the largest token count fitting at the longest *and* at the shortest example fits
    every length between: the budget is the smallest of the measured capacities (rows that fit x length) at the
    longest example, the shortest that matters, and one between them. Their three lines make the cost model
    (`token_budget.cost_model`), by which a length between may hold more rows. Each rank loads its whole window
    (micro = the per-rank target, accumulation 1); the engine cuts it."""
    per_rank = plan.target_batch_size // plan.world_size
    at_longest = result.max_micro_batch_size * seq_len
    # A forward never holds more rows than the window, so below at_longest / per_rank tokens per row the chunks
    # are whole windows whose peak grows with their length: the short end that matters is the shortest example
    # at or above that length.
    make_short, short_len = probe_batches(trainer, shortest=-(-at_longest // per_rank), lengths=lengths)
    measured = {seq_len: result}
    if short_len < seq_len:
        measured[short_len], _ = probe(make_short, short_len)
        # a third length between them pins a row's cost that does not grow with its length (cost_model)
        make_mid, mid_len = probe_batches(trainer, shortest=round(math.sqrt(short_len * seq_len)), lengths=lengths)
        if short_len < mid_len < seq_len:
            measured[mid_len], _ = probe(make_mid, mid_len)
    rows_at = {length: r.max_micro_batch_size for length, r in measured.items()}
    budget = min(rows * length for length, rows in rows_at.items())
    budget = max(budget, seq_len)  # the longest example fits alone: the first probe found micro >= 1
    model = None
    if all(r.fitted is not None for r in measured.values()):
        model = cost_model(result.fitted[0], {length: r.fitted[1] for length, r in measured.items()})
    rows_model = None
    if model is not None:
        trials = [(t, length) for length, r in measured.items() for t in r.measured_trials]
        rows_model = _usable(model, trials, result.budget_bytes, rows_at)
        rows_model["forward_tokens"] = _forward_tokens(trials)
    tokens = TokenBudget(budget, rows_model, rows_model["forward_tokens"] if rows_model else None)
    result.extra["expected"] = _expected_cuts(lengths, per_rank, tokens, result.max_micro_batch_size)
    short = min(measured)
    result.extra["token_budget"] = {
        "tokens_per_forward": budget, "longest": seq_len, "rows_at_longest": result.max_micro_batch_size,
        "shortest": short, "rows_at_shortest": rows_at[short],
        "rows_at": {str(k): v for k, v in rows_at.items()},
        "short_trials": [t.__dict__ for length, r in measured.items() if length != seq_len
                         for t in r.measured_trials],
        "cost_model": model,
    }
    return Plan(per_rank, 1, plan.world_size, plan.target_batch_size, token_budget=budget,
                token_model=rows_model), result


def _forward_tokens(trials: list) -> float | None:
    """What a forward costs beyond its tokens, in tokens: at each probed length, the intercept over the slope of
    the step times against the tokens each step held; the largest of them (a noisy, shared machine can shrink one
    line's intercept, and an under-estimate would cut windows into needlessly many forwards). The trials' steps
    include the optimizer step, so this over-estimates a forward's cost: one more forward is taken only where it
    clearly pays. None when some length lacks two timed sizes or a positive per-token time: fewest forwards."""
    by_length: dict[int, list[tuple[int, float]]] = {}
    for t, length in trials:
        if t.seconds:
            by_length.setdefault(length, []).append((t.micro_batch_size * length, t.seconds))
    estimates = []
    for points in by_length.values():
        if len({x for x, _ in points}) < 2:
            return None
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
                 / sum((x - mean_x) ** 2 for x, _ in points))
        if slope <= 0:
            return None
        estimates.append(max(0.0, (mean_y - slope * mean_x) / slope))
    return max(estimates) if estimates else None


def _usable(model: dict, trials: list, budget_bytes: int, rows_at: dict[int, int]) -> dict:
    """The cost model as `TokenBudget` reads it: the bytes rows may use, the budget less the base and less the
    model's worst under-prediction of a measured step (micro-batch 1 sits on the optimizer step's bend, which
    never binds near the budget, so it is left out)."""
    misses = [(t.reserved_bytes if t.reserved_bytes is not None else t.peak_bytes)
              - predicted_peak(model, t.micro_batch_size, length)
              for t, length in trials if t.micro_batch_size > 1 and t.peak_bytes is not None]
    usable = budget_bytes - model["base_bytes"] - max([0.0, *misses])
    return {**model, "usable_bytes": usable, "rows_at": {str(k): v for k, v in rows_at.items()}}


def _expected_cuts(lengths: list[int] | None, per_rank: int, budget: TokenBudget,
                   rows_at_longest: int) -> dict[str, float]:
    """Forwards per optimizer step and padded / real tokens this budget gives on the user's data (windows of a
    fixed shuffle), next to "samples" mode's plan at the micro-batch that fits the worst case, each cut by the rule
    that would run it (`partition_padded`, `plan.near_equal_groups`)."""
    import random

    from ..token_budget import partition_padded
    from .plan import near_equal_groups, plan_batch

    if not lengths:
        return {}
    order = list(range(len(lengths)))
    random.Random(0).shuffle(order)
    windows = [[lengths[i] for i in order[w:w + per_rank]] for w in range(0, len(order), per_rank)]
    micro = plan_batch(per_rank, 1, max(1, rows_at_longest)).micro_batch_size
    real = sum(lengths) or 1
    tokens = [partition_padded(w, budget) for w in windows]
    samples = [near_equal_groups(w, micro) for w in windows]

    def padded(cuts):
        return sum(len(g) * max(w[i] for i in g) for w, gs in zip(windows, cuts) for g in gs) / real

    return {
        "forwards_per_step": sum(map(len, tokens)) / len(windows),
        "padded_over_real": padded(tokens),
        "samples_mode_forwards_per_step": sum(map(len, samples)) / len(windows),
        "samples_mode_padded_over_real": padded(samples),
    }


def _stored_plan(output_dir: str, key: dict[str, Any]):
    """The reusable stored plan, or None. A plan file that cannot be trusted is named, then probed over."""
    try:
        return load_plan(output_dir, key)
    except PlanFileError as exc:
        logger.warning("hf_accum: ignoring the stored plan: %s. Probing again; the file will be rewritten.", exc)
        return None


# --- what the user sees ----------------------------------------------------------------------------------
def plan_figures(plan: Plan, budget_bytes: int, probe: dict[str, Any] | None, *, reused: bool) -> dict[str, float]:
    """The plan and what the probe measured, as the numbers the Trainer logs (so `report_to` records them)."""
    figures: dict[str, float] = {
        "hf_accum/micro_batch_size": plan.micro_batch_size,
        "hf_accum/gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "hf_accum/world_size": plan.world_size,
        "hf_accum/target_batch_size": plan.target_batch_size,
        "hf_accum/budget_bytes": int(budget_bytes),
        "hf_accum/plan_reused": int(reused),
        # an uneven plan's micro is the most rows of a forward: micro x accumulation can exceed the window, so the
        # window and its forwards are logged as such
        "hf_accum/window": plan.window,
        "hf_accum/forwards": plan.forwards,
    }
    if plan.token_budget is not None:
        figures["hf_accum/token_budget"] = plan.token_budget
        extra = (probe or {}).get("extra") or {}
        for name, value in extra.get("expected", {}).items():
            figures[f"hf_accum/expected_{name}" if not name.startswith("samples") else f"hf_accum/{name}"] = value
        model = (extra.get("token_budget") or {}).get("cost_model")
        for name in ("base_bytes", "per_row_bytes", "per_token_bytes", "per_token_sq_bytes"):
            if model:
                figures[f"hf_accum/cost_{name}"] = model[name]
    if plan.checkpointed_layers is not None:
        figures["hf_accum/checkpointed_layers"] = plan.checkpointed_layers
        figures["hf_accum/num_layers"] = plan.num_layers
    if plan.step_seconds is not None:
        figures["hf_accum/step_seconds"] = plan.step_seconds
    trials = (probe or {}).get("trials") or []
    measured = [t for t in trials if isinstance(t, dict) and t.get("status") != "refused"]
    figures["hf_accum/probe_trials"] = len(measured)
    # a peak says something about the plan only at the checkpointing level it runs at
    measured = [t for t in measured if t.get("checkpointed_layers") in (None, plan.checkpointed_layers)]
    # The plan's micro-batch may not have been run (a larger one was, and fit): the smallest fitting size at or
    # above it is a measured upper bound of its peak.
    above = [t for t in measured if t.get("fits") and t.get("peak_bytes") and t["micro_batch_size"] >= plan.micro_batch_size]
    if above:
        nearest = min(above, key=lambda t: t["micro_batch_size"])
        figures["hf_accum/peak_bytes_per_step"] = int(nearest["peak_bytes"])
        figures["hf_accum/peak_measured_at_micro_batch"] = int(nearest["micro_batch_size"])
    return figures


def plan_line(plan: Plan, figures: dict[str, float]) -> str:
    """The one plan line, the same in the log, the recipes and `hf-accum probe`: the plan (`Plan.describe`), the
    peak measured against the budget, and how it was found. Everything else is in the plan file and the logged
    figures (`plan_figures`)."""
    peak = figures.get("hf_accum/peak_bytes_per_step")
    at = figures.get("hf_accum/peak_measured_at_micro_batch")
    memory = f"budget {_mib(figures['hf_accum/budget_bytes'])}"
    if peak is not None:
        memory = (f"peak {'' if at == plan.micro_batch_size else '≤ '}{_mib(peak)} of {memory}")
    if plan.step_seconds is not None:
        memory += f"; {plan.step_seconds:.2f} s per optimizer step measured"
    found = "stored plan" if figures.get("hf_accum/plan_reused") else f"{figures['hf_accum/probe_trials']} probe trials"
    return f"hf_accum plan: {plan.describe()}; {memory}; {found}"


def _show(message: str, args, *values) -> None:
    """Once per run at warning level, so it is seen without any logging setup (other ranks: info)."""
    (logger.warning if args.should_log else logger.info)(message, *values)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class PlanLog(TrainerCallback):
    """Logs the plan's figures through the Trainer when training begins (after `train()` creates the state
    whose log history and `report_to` integrations record them). Holds the trainer weakly."""

    def __init__(self, trainer, figures: dict[str, float]):
        self._trainer = weakref.ref(trainer)
        self.figures = figures

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            with trainer_internals.printers_muted(trainer):  # recorded, not printed a second time (the plan line was)
                trainer.log(dict(self.figures))


def _log_in_trainer(trainer, figures: dict[str, float], in_loop: bool = False) -> None:
    if in_loop:  # training has begun: its state and `report_to` integrations record them now
        with trainer_internals.printers_muted(trainer):
            trainer.log(dict(figures))
        return
    trainer.pop_callback(PlanLog)  # a second tune() replaces the figures of the first
    trainer.add_callback(PlanLog(trainer, figures))


def probe_batches(trainer, shortest: int | None = None,
                  lengths: list[int] | None = None) -> tuple[Callable[[int], dict[str, Any]], int]:
    """``make_batch(micro)`` at the worst-case length: the longest training example, collated ``micro`` times
    (or random tokens at ``probe_seq_len`` for causal LMs), and that length. ``shortest=n``: the shortest example
    of at least n tokens instead (the token-budget probe's second length; the longest when none is shorter).
    ``lengths``: the examples' lengths when already read (`_train_lengths`)."""
    args = trainer.args
    if args.probe_seq_len is not None:
        if not loss_shifts_labels(trainer.model):
            raise ValueError(
                f"probe_seq_len={args.probe_seq_len} builds random causal-LM batches, but "
                f"{type(trainer.model).__name__} is not a causal LM. Leave probe_seq_len unset: the probe then "
                "measures with the longest training example."
            )
        length = min(args.probe_seq_len, max(shortest, args.probe_seq_len // 8)) if shortest else args.probe_seq_len
        return random_token_batch(trainer.model, length), length
    loader = trainer.get_train_dataloader()
    dataset, collate = loader.dataset, loader.collate_fn
    try:
        size = len(dataset)
    except TypeError:
        raise ValueError(
            "The training set is an iterable dataset, so its longest example is unknown; set probe_seq_len to the "
            "longest sequence length training will see."
        ) from None
    if size == 0:
        raise ValueError("train_dataset is empty: nothing to probe or train on.")
    if lengths is None:
        lengths = [_length(dataset[i]) for i in range(size)]  # one pass over the data
    longest = max(range(size), key=lengths.__getitem__)
    if shortest:
        candidates = [i for i in range(size) if lengths[i] >= shortest] or [longest]
        longest = min(candidates, key=lengths.__getitem__)
    example = dataset[longest]
    rows = _padded_rows(example, collate)

    def make_batch(micro: int) -> dict[str, Any]:
        return trainer_internals.prepare_inputs(trainer, collate(rows(micro)))

    first = make_batch(1)
    seq_len = next((v.shape[1] for v in first.values() if torch.is_tensor(v) and v.dim() >= 2), 1)
    max_positions = getattr(getattr(trainer.model, "config", None), "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(
            f"The longest training example is {seq_len} tokens after collation, beyond the model's "
            f"max_position_embeddings={max_positions}. Truncate examples to at most {max_positions} tokens "
            "(e.g. tokenizer(..., truncation=True, max_length=...))."
        )
    return make_batch, int(seq_len)


def _train_lengths(trainer) -> list[int] | None:
    """Every training example's length; None for an iterable dataset (`probe_batches` says what to set)."""
    dataset = trainer.train_dataset
    try:
        return [_length(dataset[i]) for i in range(len(dataset))]
    except TypeError:
        return None


def _padded_rows(example, collate) -> Callable[[int], list]:
    """``rows(micro)``: the example ``micro`` times; where the collator pads, the last one a token shorter, so
    the batch carries a padding mask as training's batches of mixed lengths do. A padding mask can cost more
    than the tokens (SDPA falls back to kernels that build the masked scores), and one pad token leaves the
    batch's real tokens, and so every per-token cost, as they were."""
    n = _length(example)
    if not isinstance(example, dict) or n < 2:
        return lambda micro: [example] * micro
    shorter = {k: v[:-1] if hasattr(v, "__len__") and not isinstance(v, str) and len(v) == n else v
               for k, v in example.items()}
    mask = collate([example, shorter]).get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or bool(mask.all()):
        return lambda micro: [example] * micro  # the collator does not pad (e.g. padding-free): nothing to mimic
    return lambda micro: [example] * (micro - 1) + [shorter] if micro > 1 else [example]


def _length(example) -> int:
    if isinstance(example, dict):
        for key in ("input_ids", "inputs_embeds", "pixel_values"):
            if key in example:
                return len(example[key])
        return max((len(v) for v in example.values() if hasattr(v, "__len__") and not isinstance(v, str)), default=0)
    return len(example) if hasattr(example, "__len__") else 0


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
