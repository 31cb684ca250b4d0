"""The token budget, measured (`micro_batching="tokens"`): the probe's measurements at the longest, the shortest
and a middle example turned into the most tokens one forward may hold, its cost model (`token_budget.cost_model`)
and what it is expected to cut the user's data into. The cutting itself is token_budget.py's."""

from __future__ import annotations

import math

from ..probing.loop import ProbeResult
from ..probing.plan import Plan
from ..window.token_budget import TokenBudget, cost_model, fit_step_time, predicted_peak
from .data_scan import probe_batches


def token_plan(trainer, plan: Plan, result: ProbeResult, seq_len: int, probe,
               lengths: list[int] | None) -> tuple[Plan, ProbeResult]:
    """``micro_batching="tokens"``: the most tokens one forward may hold, measured, not extrapolated.

    For a fixed token count, a step's peak is convex in the padded length (per-row terms fall, attention's
    quadratic term grows), so the largest token count fitting at the longest *and* at the shortest example fits
    every length between: the budget is the smallest of the measured capacities (rows that fit x length) at the
    longest example, the shortest that matters, and one between them. Their three lines make the cost model
    (`token_budget.cost_model`), by which a length between may hold more rows. The plain steps each probe timed (one
    forward from its largest fit down to one row, halving, and the optimizer's step alone: `step_timing.py`) give the
    step-time model (`step_time.fit_step_time`) by which the window's number of forwards is chosen; without it (a probe that timed
    nothing) the padding rule cuts. Each rank loads its whole window (micro = the per-rank target, accumulation 1);
    the engine cuts it."""
    per_rank = plan.target_batch_size // plan.world_size
    at_longest = result.max_micro_batch_size * seq_len
    # A forward never holds more rows than the window, so below at_longest / per_rank tokens per row the chunks
    # are whole windows whose peak grows with their length: the short end that matters is the shortest example
    # at or above that length.
    def batches(shortest):  # GRPO's: its own training batches (adapter.probe_batches)
        return trainer._adapter.probe_batches(trainer, shortest) or probe_batches(trainer, shortest, lengths)

    make_short, short_len = batches(-(-at_longest // per_rank))
    measured = {seq_len: result}
    if short_len < seq_len:
        measured[short_len], _ = probe(make_short, short_len)
        # a third length between them pins a row's cost that does not grow with its length (cost_model)
        make_mid, mid_len = batches(round(math.sqrt(short_len * seq_len)))
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
    timed = _timings(measured, "step_times")
    optimizer = [s for r in measured.values() if (s := r.extra.get("optimizer_step_seconds"))]
    step_time = fit_step_time(timed, optimizer)
    tokens = TokenBudget(budget, rows_model, step_time=step_time)
    result.extra["expected"] = _expected_cuts(lengths, per_rank, tokens, result.max_micro_batch_size,
                                              packable=_packable(trainer.model, make_short))
    short = min(measured)
    result.extra["token_budget"] = {
        "tokens_per_forward": budget, "longest": seq_len, "rows_at_longest": result.max_micro_batch_size,
        "shortest": short, "rows_at_shortest": rows_at[short],
        "rows_at": {str(k): v for k, v in rows_at.items()},
        "short_trials": [t.__dict__ for length, r in measured.items() if length != seq_len
                         for t in r.measured_trials],
        "cost_model": model,
        "step_times": _as_json(timed),
        "optimizer_step_seconds": optimizer,  # each probe's optimizer step alone, subtracted from its steps
        "step_time": step_time,
    }
    return Plan(per_rank, 1, plan.world_size, plan.target_batch_size, token_budget=budget,
                token_model=rows_model, step_time=step_time), result


def _timings(measured: dict[int, ProbeResult], key: str) -> dict[int, dict[int, float]]:
    """``{length: {rows: seconds}}`` of each probe's timed steps under ``key`` (`step_timing.time_rows`)."""
    return {length: {int(rows): s for rows, s in r.extra.get(key, {}).items()} for length, r in measured.items()}


def _as_json(timings: dict[int, dict[int, float]]) -> dict[str, dict[str, float]]:
    return {str(length): {str(rows): s for rows, s in by_rows.items()} for length, by_rows in timings.items()}


def _usable(model: dict, trials: list, budget_bytes: int, rows_at: dict[int, int]) -> dict:
    """The cost model as `TokenBudget` reads it: the bytes rows may use, the budget less the base and less the
    model's worst under-prediction of a measured step (micro-batch 1 sits on the optimizer step's bend, which
    never binds near the budget, so it is left out)."""
    misses = [(t.reserved_bytes if t.reserved_bytes is not None else t.peak_bytes)
              - predicted_peak(model, t.micro_batch_size, length)
              for t, length in trials if t.micro_batch_size > 1 and t.peak_bytes is not None]
    usable = budget_bytes - model["base_bytes"] - max([0.0, *misses])
    return {**model, "usable_bytes": usable, "rows_at": {str(k): v for k, v in rows_at.items()}}


def _packable(model, make_batch) -> bool:
    """Whether the user's padded rows could run padding-free instead (one row of concatenated sequences with
    position_ids: `DataCollatorWithFlattening`, TRL's ``padding_free=True``): a decoder-only model whose forward
    takes position_ids, and a probe batch of two rows that pads (a padding mask with zeros)."""
    import inspect

    import torch

    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return False
    try:
        mask = make_batch(2).get("attention_mask")
    except Exception:  # noqa: BLE001 -- a batch the probe cannot make says nothing either way
        return False
    return torch.is_tensor(mask) and mask.dim() == 2 and not bool(mask.all())


def _expected_cuts(lengths: list[int] | None, per_rank: int, budget: TokenBudget,
                   rows_at_longest: int, packable: bool = False) -> dict[str, float]:
    """Forwards per optimizer step and padded / real tokens this budget gives on the user's data (windows of a
    fixed shuffle), next to "samples" mode's plan at the micro-batch that fits the worst case, each cut by the rule
    that would run it (`partition_padded`, `window.cuts.near_equal_groups`). ``packable``: also what padding-free
    rows under the same token count would take (`partition_packed`; a packed forward holds no padding mask, so the
    padded budget bounds it), and with a step-time model the modelled seconds of both (a packed sequence's
    attention is its own length's)."""
    from ..probing.plan import plan_batch
    from ..window.cuts import near_equal_groups
    from ..window.kernel_budget import data_windows
    from ..window.token_budget import modelled_seconds, packed_seconds, partition_packed, partition_padded

    if not lengths:
        return {}
    windows = data_windows(lengths, per_rank)
    micro = plan_batch(per_rank, 1, max(1, rows_at_longest)).micro_batch_size
    real = sum(lengths) or 1
    tokens = [partition_padded(w, budget) for w in windows]
    samples = [near_equal_groups(w, micro) for w in windows]

    def padded(cuts):
        return sum(len(g) * max(w[i] for i in g) for w, gs in zip(windows, cuts) for g in gs) / real

    out = {
        "forwards_per_step": sum(map(len, tokens)) / len(windows),
        "padded_over_real": padded(tokens),
        "samples_mode_forwards_per_step": sum(map(len, samples)) / len(windows),
        "samples_mode_padded_over_real": padded(samples),
    }
    if packable:
        packed = [partition_packed(w, budget) for w in windows]
        out["padding_free_forwards_per_step"] = sum(map(len, packed)) / len(windows)
        st = budget.step_time
        if st is not None:
            out["step_seconds_modelled"] = sum(modelled_seconds(st, w, g) for w, g in zip(windows, tokens)) / len(windows)
            out["padding_free_step_seconds_modelled"] = sum(
                packed_seconds(st, [w[lo:hi] for lo, hi in spans]) for w, spans in zip(windows, packed)) / len(windows)
    return out
