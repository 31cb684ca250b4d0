"""Section 8, levers: micro-batch x per-layer level swept, then the tuner's choice measured the same way."""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from typing import Any

import torch

from hf_accum.probing.probe import make_step_fn, random_token_batch
from hf_accum.window.oom import free_memory, is_oom

from .context import Ctx, _mib, plan_facts, release, typical
from .data import goal, lm_rows, make_trainer


# --- section 8: the per-layer levers, swept -----------------------------------------------------------------------
def lever_levels(ctx: Ctx, num_layers: int) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """(kind, k) for none and each lever at k in {L/2, L}; levers this device lacks, with the reason."""
    from hf_accum.levers import activation_offload as offload

    ks = sorted({max(1, num_layers // 2), num_layers})
    kinds = ["full", "selective", "offload"]
    skipped = {}
    why = offload.why_unavailable(ctx.device)
    if why is not None:
        kinds.remove("offload")
        skipped["offload"] = why
    return [("none", 0)] + [(kind, k) for kind in kinds for k in ks], skipped


def lever_context(model, kind: str, k: int, num_layers: int):
    """The model with ``k`` decoder layers at one level (the first k; the mechanics directly, no registry)."""
    from hf_accum.compat import gradient_checkpointing
    from hf_accum.levers import activation_offload as offload
    from hf_accum.levers import selective

    if kind == "plan":  # the tuner's choice: k = (full, selective) layers, the first full, the next selective
        return selective.layer_levels(model, k[0], k[1], {"use_reentrant": False})
    if kind == "none" or k == 0:
        return contextlib.nullcontext()
    if kind == "full":
        return gradient_checkpointing.checkpointed_layers(model, k, {"use_reentrant": False})
    if kind == "selective":
        return selective.layer_levels(model, 0, k, {"use_reentrant": False})
    return offload.offloaded_layers(model, offload.layout(num_layers, 0, 0, k))


def training_loss(model):
    """(context, how): the loss AccumTrainer trains with, so the sweep measures what the tuner plans for: the fused
    LM loss where supported (the trainer's default: the logits never materialize), else the model's own."""
    from hf_accum.levers.kernels import fused_loss as fl

    why = fl.unsupported_reason(model)
    return (fl.fused_lm_loss(model), "fused LM loss") if why is None else (contextlib.nullcontext(), why)


def lever_point(ctx: Ctx, model, opt, step, level: tuple[str, int], micro: int, seq: int) -> dict[str, Any]:
    """One grid point: the peak of a step (allocated, reserved on CUDA) and the fastest of 3 timed steps; an
    out-of-memory step is recorded as "OOM" and its memory given back."""
    kind, k = level
    row: dict[str, Any] = {"level": kind, "layers": k, "micro": micro}
    meter = ctx.meter(model, opt)
    oom = False
    with lever_context(model, kind, k, len(_decoder_layers(model))):
        try:
            m = meter.measure(lambda: step(micro))
            seconds = min(meter.time(lambda: step(micro)) for _ in range(3))
        except Exception as exc:
            if not is_oom(exc):
                raise
            oom = True
    if oom:
        model.zero_grad(set_to_none=False)
        free_memory()
        return {**row, "result": "OOM"}
    return {**row, "result": "ok", "step_seconds": seconds, "tokens_per_second": micro * seq / seconds,
            "peak_allocated_bytes": m.peak_bytes, "peak_reserved_bytes": m.reserved_bytes,
            "charged_bytes": m.charged_bytes}


def _decoder_layers(model) -> list:
    from hf_accum.compat import gradient_checkpointing

    return gradient_checkpointing.checkpointable_layers(model)


def lever_sweep(ctx: Ctx, model, seq: int, levels: list[tuple[str, int]], end: float) -> tuple[list, list]:
    """Every micro-batch x level, smallest micro-batches first (so a cut keeps every level's small sizes); a level
    that ran out of memory at m is not run above m. (rows, points not run with the reason)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = make_step_fn(model, opt, random_token_batch(model, seq))
    rows, not_run, durations = [], [], []
    oom_at: dict[tuple[str, int], int] = {}
    loss, _ = training_loss(model)
    try:
        loss.__enter__()
        step(1)  # AdamW's state and the kernels, before the first measured point
        for micro in ctx.s.micros8:
            for level in levels:
                point = {"level": level[0], "layers": level[1], "micro": micro}
                if level in oom_at:
                    not_run.append({**point, "reason": f"OOM at micro {oom_at[level]}"})
                elif time.monotonic() + typical(durations) >= end or ctx.clock.out(typical(durations)):
                    not_run.append({**point, "reason": "time limit"})
                else:
                    started = time.monotonic()
                    row = lever_point(ctx, model, opt, step, level, micro, seq)
                    durations.append(time.monotonic() - started)
                    rows.append(row)
                    oom_at.update({level: micro} if row["result"] == "OOM" else {})
                    print(f"  {_lever_line(row)}", flush=True)
    finally:
        loss.__exit__(None, None, None)
        opt.state.clear()
        model.zero_grad(set_to_none=True)
        del opt
        free_memory()
    return rows, not_run


def _lever_line(row: dict) -> str:
    head = f"{row['level']:>9} k={row['layers']:<2} micro {row['micro']:<3}"
    if row["result"] != "ok":
        return f"{head} {row['result']}"
    return (f"{head} {row['step_seconds']:.3f} s/step, {row['tokens_per_second']:.0f} tokens/s, peak "
            f"{_mib(row['peak_allocated_bytes'])} allocated, {_mib(row['peak_reserved_bytes'])} reserved")


def tuner_budget(rows: list[dict], num_layers: int) -> tuple[int | None, str | None]:
    """Halfway between micro 1's charged peak without checkpointing and with half the layers checkpointed: no
    checkpointing does not fit, a partly checkpointed level does. (None, why) when the sweep lacks either point."""
    def charged(kind: str, k: int) -> int | None:
        found = [r for r in rows if (r["level"], r["layers"], r["micro"]) == (kind, k, 1) and r["result"] == "ok"]
        return found[0]["charged_bytes"] if found else None

    none, half = charged("none", 0), charged("full", max(1, num_layers // 2))
    if none is None or half is None or half >= none:
        return None, f"micro 1 not measured (or no lower) without and with half the layers checkpointed: {none}, {half}"
    return (none + half) // 2, None


def tuner_choice(ctx: Ctx, model, seq: int, budget: int) -> dict[str, Any]:
    """AccumTrainer's tuner (checkpoint_layers='auto') under ``budget``: its plan, probe seconds, and its point
    measured like the sweep's."""
    target = ctx.s.target8
    rows = lm_rows([seq] * (2 * target), ctx.s.model["vocab_size"], seed=8)
    with tempfile.TemporaryDirectory(prefix="bench_gpu8_") as tmp:
        trainer = make_trainer(ctx, model, rows, tmp, target_batch_size=target, max_steps=1,
                               checkpoint_layers="auto", memory_budget_bytes=budget)
        try:
            start = time.perf_counter()
            plan = trainer.tune()
            out = {"budget_bytes": budget, "target": target, "plan": plan_facts(plan),
                   "probe_seconds": time.perf_counter() - start}
        finally:
            release(trainer)
            model.zero_grad(set_to_none=True)
    facts = out["plan"]
    micro, levers = facts.get("rows_per_forward_effective"), facts.get("levers") or {}
    record = levers.get("selective") or {}  # the searched lever's record (selective contains checkpointing's levels)
    k = (record.get("full", (levers.get("checkpointing") or {}).get("layers", 0)), record.get("selective", 0))
    if micro and not ctx.clock.out():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        step = make_step_fn(model, opt, random_token_batch(model, seq))
        try:
            with training_loss(model)[0]:
                step(1)
                out["measured"] = lever_point(ctx, model, opt, step, ("plan", k), int(micro), seq)
                out["measured"]["layers"] = f"{k[0]}f+{k[1]}s"  # full + selective, as printed
        finally:
            opt.state.clear()
            release(opt)
    return out


def section_levers(ctx: Ctx) -> dict[str, Any]:
    """Micro-batch x per-layer level (none / full / selective checkpointing / offload of k layers) on the section's
    Llama at seq8: step time (fastest of 3) and peak memory per point; then the tuner's choice under a budget only
    partly checkpointed levels fit. Capped at cap8 seconds, whatever --minutes leaves."""
    seq = ctx.s.seq8
    limit = min(ctx.s.cap8, max(0.0, ctx.clock.left()))
    end, sweep_end = time.monotonic() + limit, time.monotonic() + 0.75 * limit  # the rest for the tuner
    model = ctx.llama()
    num_layers = len(_decoder_layers(model))
    levels, skipped = lever_levels(ctx, num_layers)
    figures: dict[str, Any] = {"seq_len": seq, "micros": list(ctx.s.micros8), "num_layers": num_layers,
                               "levels": [f"{kind} {k}" for kind, k in levels], "skipped": skipped,
                               "cap_seconds": ctx.s.cap8, "loss": training_loss(model)[1]}
    for why in skipped.values():
        print(f"  {why}", flush=True)
    try:
        rows, not_run = lever_sweep(ctx, model, seq, levels, sweep_end)
        figures.update(rows=rows, not_run=not_run)
        budget, why = tuner_budget(rows, num_layers)
        if budget is None or time.monotonic() >= end:
            figures["tuner"] = {"skipped": why or "time limit"}
        else:
            figures["tuner"] = tuner_choice(ctx, model, seq, budget)
    finally:
        release(model)
    return {"figures": figures, "goals": lever_goals(figures), "partial": bool(not_run_for_time(figures))}


def not_run_for_time(figures: dict) -> list:
    return [p for p in figures.get("not_run", []) if p["reason"] == "time limit"]


def window_seconds(row: dict, target: int) -> float:
    """One optimizer step of ``target`` samples at a sweep point: ceil(target / micro) forwards of its step time."""
    return math.ceil(target / row["micro"]) * row["step_seconds"]


def lever_goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    ok = [r for r in figures.get("rows", []) if r["result"] == "ok"]
    best = min(ok, key=lambda r: r["step_seconds"] / r["micro"], default=None)
    tuner = figures.get("tuner", {})
    plan, measured = tuner.get("plan", {}), tuner.get("measured", {})
    fits = ratio = None
    if measured.get("result") == "ok":
        fits = measured["charged_bytes"] <= tuner["budget_bytes"]
        # the tuner chooses among none / selective / full checkpointing per layer (hf_accum/levers/selective.py): the
        # sweep's best of those within the budget
        within = [r for r in ok if r["level"] in ("none", "full", "selective")
                  and r["charged_bytes"] <= tuner["budget_bytes"]]
        if within:
            sweep_best = min(window_seconds(r, tuner["target"]) for r in within)
            ratio = window_seconds(measured, tuner["target"]) / sweep_best
            tuner["sweep_best_window_seconds"] = sweep_best
    return [goal("grid points measured (OOM points included)", len(figures.get("rows", [])), "info", None),
            goal("fastest point per sample", f"{best['level']} k={best['layers']} micro {best['micro']}"
                 if best else None, "info", None),
            goal("tuner's choice (micro, lever levels)",
                 f"{plan.get('rows_per_forward_effective')}, {plan.get('levers')}" if plan else None,
                 "info", None),
            goal("tuner's choice measured within its budget", fits, "True", fits),
            goal("tuner's optimizer step over the sweep's best within the budget (none/selective/full points)", ratio,
                 "<= 1.05", ratio <= 1.05 if ratio is not None else None)]
