"""How a probe and its plan are shown: the table, the JSON file and the plot of `hf-accum probe`, the one plan line
(the log, the recipes and `hf-accum probe`) and the figures the Trainer logs (`plan_figures`). Bytes are written by
`meters.format_bytes`, the one byte formatter."""

from __future__ import annotations

import json
from typing import Any

from .loop import ProbeResult
from .meters import MiB, format_bytes
from .plan import Plan


def _mib(n: float | None) -> str:  # a table cell under a "MiB" header
    return format_bytes(n, "MiB", none="-")


def table(result: ProbeResult, seq_len: int) -> str:
    levels = any(t.checkpointed_layers is not None for t in result.trials)  # the probe chose a checkpointing level
    rows = [("| checkpointed layers " if levels else "")
            + "| micro | peak alloc MiB | peak reserved MiB | step s | samples/s | tokens/s | fits |",
            ("|---:" if levels else "") + "|---:|---:|---:|---:|---:|---:|:---|"]
    for t in sorted(result.trials, key=lambda t: (t.checkpointed_layers or 0, t.micro_batch_size)):
        sps = t.samples_per_second
        rows.append(
            (f"| {t.checkpointed_layers} " if levels else "") +
            f"| {t.micro_batch_size} | {_mib(t.peak_bytes)} | {_mib(t.reserved_bytes)} | "
            f"{'-' if t.seconds is None else f'{t.seconds:.3f}'} | {'-' if sps is None else f'{sps:.1f}'} | "
            f"{'-' if sps is None else f'{sps * seq_len:,.0f}'} | {t.status} |"
        )
    return "\n".join(rows)


def summary(result: ProbeResult, plan: Plan, seq_len: int, budget_source: str | None = None) -> str:
    lines = []
    if result.fitted is not None:
        a, b = result.fitted
        lines.append(f"memory model: peak ≈ {_mib(a)} MiB + {_mib(b)} MiB × micro-batch (seq {seq_len})" if a >= 0 else
                     # a line through few points can cross zero below micro-batch 1: no memory is negative
                     f"memory model: peak grows {_mib(b)} MiB per micro-batch row (seq {seq_len}; the fitted line "
                     "crosses zero below micro-batch 1, a fitting artefact: read the measured peaks)")
    lines.append(f"budget {_mib(result.budget_bytes)} MiB of {_mib(result.capacity_bytes)} MiB on {result.device}"
                 + (f" ({budget_source})" if budget_source else ""))
    levels = result.extra.get("checkpointing")
    if levels is not None:
        for level in levels["levels"]:
            lines.append(f"checkpointing {level['k']} of {levels['num_layers']} layers: largest measured fit "
                         f"{level['largest_fit']}")
        if "chosen" in levels:
            chosen = levels["chosen"]
            seconds = levels["step_seconds"]  # None on paper: chosen by memory, the fewest forwards then layers
            how = "by memory (no step times)" if seconds is None else f"~{seconds:.3f} s per optimizer step"
            lines.append(f"chosen: checkpointing {chosen['k']} of {levels['num_layers']} layers, {chosen['forwards']} "
                         f"forwards of <= {chosen['micro']} rows, {how} ({levels['verify_steps']} verifying steps)")
    lines.append(f"largest micro-batch that fits: {result.max_micro_batch_size}")
    if result.next_size:
        lines.append(_next_size_line(result))
    lines.append(f"plan: {plan.describe()}  ({plan.target_batch_size * seq_len:,} tokens per optimizer step at "
                 f"seq {seq_len})")
    lines += estimate_lines(result)
    return "\n".join(lines)


def _next_size_line(result: ProbeResult) -> str:
    """Why the plan does not take fewer forwards: the smallest size that would (the next of the plan's sizes, see
    `plan.forward_breakpoints`) and how it is known not to fit."""
    size, how = result.next_size, result.next_verdict
    what = f"the next size that would take fewer forwards, {size},"
    if how == "untried":
        return f"{what} was not tried (the search stopped within its goal of the budget)"
    if how == "predicted":
        return f"{what} does not fit (predicted by the memory model)"
    failed = min((t.micro_batch_size for t in result.trials if not t.fits), default=size)
    return f"{what} does not fit ({'measured' if failed == size else f'{failed}, smaller, was measured not to'})"


def to_json(result: ProbeResult, plan: Plan, seq_len: int) -> dict[str, Any]:
    data = result.to_dict()
    return {
        **plan.to_dict(),
        "max_micro_batch_size": result.max_micro_batch_size,
        "budget_bytes": result.budget_bytes,
        "capacity_bytes": result.capacity_bytes,
        "device": result.device,
        "seq_len": seq_len,
        "fitted": data["fitted"],
        "trials": data["trials"],
        **({"estimate": result.extra["estimate"]} if "estimate" in result.extra else {}),
    }


def write_json(path: str, result: ProbeResult, plan: Plan, seq_len: int) -> None:
    with open(path, "w") as f:
        json.dump(to_json(result, plan, seq_len), f, indent=2, default=str)


def write_plot(path: str, result: ProbeResult, plan: Plan, *, seq_len: int | None = None, model: str | None = None,
               budget_source: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot(result, plan, seq_len=seq_len, model=model, budget_source=budget_source)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(result: ProbeResult, plan: Plan, *, seq_len: int | None = None, model: str | None = None,
         budget_source: str | None = None):
    """The memory curve: measured steps (a legend entry only for a kind that has points), the fitted line, the
    budget with its value (and where it came from), and the chosen micro-batch: measured, or marked as read off
    the fitted line when the probe never ran that size. The title names the model and the sequence length."""
    import matplotlib.pyplot as plt

    measured = sorted((t.micro_batch_size, t.peak_bytes / MiB, t.fits) for t in result.trials if t.peak_bytes)
    rows = plan.micro_batch_size  # the largest forward of the plan's cut
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for fits, style in ((True, dict(color="tab:green", label="measured: fits")),
                        (False, dict(color="tab:red", marker="x", label="measured: over budget"))):
        points = [(m, p) for m, p, f in measured if f is fits]
        if points:
            ax.scatter([m for m, _ in points], [p for _, p in points], **style)
    if result.fitted is not None:
        top = max([m for m, _, _ in measured] + [rows]) + 1
        a, b = result.fitted
        ax.plot([0, top], [a / MiB, (a + b * top) / MiB], color="gray", linestyle=":", label="fitted a + b·micro")
    for t in result.trials:  # the checkpointing level each point ran at, when the probe chose one
        if t.peak_bytes and t.checkpointed_layers is not None:
            ax.annotate(f"k={t.checkpointed_layers}", (t.micro_batch_size, t.peak_bytes / MiB), fontsize=7,
                        xytext=(4, -10), textcoords="offset points")
    budget = f"budget {_mib(result.budget_bytes)} MiB" + (f" ({budget_source})" if budget_source else "")
    ax.axhline(result.budget_bytes / MiB, color="tab:orange", linestyle="--", label=budget)
    level = (result.extra.get("checkpointing") or {}).get("chosen_k")
    at_level = [t for t in result.trials if t.peak_bytes and t.checkpointed_layers in (None, level)]
    chosen = next((t.peak_bytes / MiB for t in at_level if t.micro_batch_size == rows), None)
    if chosen is not None:
        ax.scatter([rows], [chosen], s=160, facecolors="none", edgecolors="black", label=f"chosen micro {rows} (measured)")
    elif result.fitted is not None:  # a size the probe never ran (a divisor below the largest that fits)
        chosen = (result.fitted[0] + result.fitted[1] * rows) / MiB
        ax.scatter([rows], [chosen], s=160, facecolors="none", edgecolors="black", linestyles="dashed",
                   label=f"chosen micro {rows} (not measured: on the fitted line)")
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("peak memory (MiB)")
    what = ", ".join(x for x in (model, f"seq {seq_len}" if seq_len else None) if x)
    ax.set_title((what + "\n" if what else "") + plan.describe(), fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return fig


# --- the estimate beside the measurement (a probe started from the estimate: `seed.py`) ----------------------
def predicted_vs_measured(result: ProbeResult) -> list[tuple[int, float, int, str]]:
    """``(micro, predicted bytes, measured peak bytes, how predicted)`` for every size the probe measured, when the
    probe recorded an estimate (``result.extra["estimate"]``): the estimate's own peak at that size ("ran"), else its
    line through the sizes it ran ("line"). Empty without an estimate."""
    estimate = result.extra.get("estimate")
    if not estimate:
        return []
    peaks = {int(k): v for k, v in estimate.get("peaks", {}).items()}
    line = estimate.get("fitted")
    rows = []
    for t in sorted(result.measured_trials, key=lambda t: t.micro_batch_size):
        if t.peak_bytes is None:
            continue
        if t.micro_batch_size in peaks:
            rows.append((t.micro_batch_size, peaks[t.micro_batch_size], t.peak_bytes, "ran"))
        elif line is not None:
            rows.append((t.micro_batch_size, line[0] + line[1] * t.micro_batch_size, t.peak_bytes, "line"))
    return rows


def estimate_lines(result: ProbeResult) -> list[str]:
    """The estimate the probe started from, then predicted vs measured at each size both have (see
    `predicted_vs_measured`); nothing when the probe did not start from an estimate."""
    estimate = result.extra.get("estimate")
    if not estimate:
        return []
    lines = [f"estimate ({estimate.get('device')}, fake tensors): largest fit {estimate['largest_fit']}, measured "
             f"{result.max_micro_batch_size}"]
    for micro, predicted, measured, how in predicted_vs_measured(result):
        lines.append(f"  micro {micro}: predicted {_mib(predicted)} MiB{' (its line)' if how == 'line' else ''}, "
                     f"measured {_mib(measured)} MiB ({predicted / measured - 1:+.1%})")
    return lines


# --- the plan line and the logged figures ---------------------------------------------------------------
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
    if plan.levers:
        from ..levers import get_lever  # lazily: the report is imported without torch's models

        for name, record in plan.levers.items():
            figures.update(get_lever(name).figures(record))
    if plan.step_seconds is not None:
        figures["hf_accum/step_seconds"] = plan.step_seconds
    trials = (probe or {}).get("trials") or []
    measured = [t for t in trials if isinstance(t, dict) and t.get("status") != "refused"]
    figures["hf_accum/probe_trials"] = len(measured)
    # a peak says something about the plan only at the lever level it runs at
    level = (((probe or {}).get("extra") or {}).get("checkpointing") or {}).get("chosen_k")
    measured = [t for t in measured if t.get("checkpointed_layers") in (None, level)]
    # The plan's micro-batch may not have been run (a larger one was, and fit): the smallest fitting size at or
    # above it is a measured upper bound of its peak.
    above = [t for t in measured if t.get("fits") and t.get("peak_bytes") and t["micro_batch_size"] >= plan.micro_batch_size]
    if above:
        nearest = min(above, key=lambda t: t["micro_batch_size"])
        figures["hf_accum/peak_bytes_per_step"] = int(nearest["peak_bytes"])
        figures["hf_accum/peak_measured_at_micro_batch"] = int(nearest["micro_batch_size"])
    return figures


def plan_line(plan: Plan, figures: dict[str, float], loss: str | None = None) -> str:
    """The one plan line, the same in the log, the recipes and `hf-accum probe`: the plan (`Plan.describe`), the
    loss path where the plan's levers do not name it (``loss``, `fused_loss.loss_path`), the peak measured against
    the budget, and how it was found. Everything else is in the plan file and the logged figures (`plan_figures`)."""
    peak = figures.get("hf_accum/peak_bytes_per_step")
    at = figures.get("hf_accum/peak_measured_at_micro_batch")
    memory = f"budget {format_bytes(figures['hf_accum/budget_bytes'])}"
    if peak is not None:
        memory = (f"peak {'' if at == plan.micro_batch_size else '≤ '}{format_bytes(peak)} of {memory}")
    if plan.step_seconds is not None:
        memory += f"; {plan.step_seconds:.2f} s per optimizer step measured"
    found = "stored plan" if figures.get("hf_accum/plan_reused") else f"{figures['hf_accum/probe_trials']} probe trials"
    loss = f"{loss}; " if loss else ""
    return f"hf_accum plan: {plan.describe()}; {loss}{_cuts(figures)}{memory}; {found}"


def _cuts(figures: dict[str, float]) -> str:
    """A token budget's cuts of the user's data, per optimizer step, next to "samples" mode's (`_expected_cuts`)."""
    padded = figures.get("hf_accum/expected_padded_over_real")
    if padded is None:
        return ""
    packed = figures.get("hf_accum/expected_padding_free_forwards_per_step")
    if packed is not None:  # the model could run the same windows padding-free: what that would save
        padded_s = figures.get("hf_accum/expected_step_seconds_modelled")
        packed_s = figures.get("hf_accum/expected_padding_free_step_seconds_modelled")
        modelled = f", modelled {packed_s:.3g} s per step against {padded_s:.3g}" if padded_s and packed_s else ""
        packed = (f"; padding-free rows (DataCollatorWithFlattening, TRL padding_free=True) would take {packed:.1f} "
                  f"forwards at padded/real 1.00{modelled}")
    return (f"per step {figures['hf_accum/expected_forwards_per_step']:.1f} forwards, padded/real {padded:.2f} "
            f"(samples mode {figures['hf_accum/samples_mode_forwards_per_step']:.1f}, "
            f"{figures['hf_accum/samples_mode_padded_over_real']:.2f}{packed or ''}); ")
