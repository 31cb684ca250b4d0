"""Section 3, train: AccumTrainer trains each plan for 50 steps on long-tailed data: OOMs (goal 0), peak reserved vs the budget."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from hf_accum.probing.meters import CpuMeter, live_tensor_bytes
from hf_accum.window.oom import free_memory

from .context import Ctx, _error, _mib, checkpointing_args, plan_facts, release, set_checkpointing, typical
from .data import budget_kwargs, budget_label, goal, lm_rows, long_tailed_lengths, make_trainer, oom_log, peak_at_one
from .s2_probe import methods


# --- section 3: 50 steps at each plan ----------------------------------------------------------------------------
def train_at_plan(ctx: Ctx, model, ckpt: bool, seq: int, budget: tuple[str, float], steps: int, target: int,
                  out: str) -> dict[str, Any]:
    lengths = long_tailed_lengths(steps * target, seq, seed=seq + steps)
    rows = lm_rows(lengths, ctx.s.model["vocab_size"], seed=1)
    kw = budget_kwargs(ctx, budget, lambda: peak_at_one(ctx, model, seq))
    trainer = make_trainer(ctx, model, rows, out, target_batch_size=target, max_steps=steps,
                           **checkpointing_args(ckpt), **kw)
    try:
        start = time.perf_counter()
        plan = trainer.tune()
        probe_s = time.perf_counter() - start
        budget_bytes = trainer.probe_result.budget_bytes if trainer.probe_result is not None else None
        ooms_before = ctx.num_ooms()
        ctx.reset_peak()
        with oom_log() as log:
            start = time.perf_counter()
            if ctx.cuda:
                trainer.train()
                peak = ctx.peak_reserved()
            else:
                peak = CpuMeter(resident=lambda: live_tensor_bytes(model)).measure(trainer.train).peak_bytes
            train_s = time.perf_counter() - start
        used, why = ctx.nvml_used()
        return {
            "longest_example": max(lengths), "plan": plan_facts(plan), "plan_after": plan_facts(trainer.plan),
            "probe_seconds": probe_s, "train_seconds": train_s, "steps": trainer.state.global_step,
            "budget_bytes": budget_bytes, "peak_bytes": peak,
            "peak_kind": "torch.cuda.max_memory_reserved" if ctx.cuda else "CpuMeter peak (tensor bytes)",
            "peak_over_budget": peak / budget_bytes if peak and budget_bytes else None,
            "oom_warnings": len(log.messages),
            "allocator_ooms": None if ooms_before is None else ctx.num_ooms() - ooms_before,
            "nvml_used_bytes_end": used, **({"nvml_null_reason": why} if why else {}),
        }
    finally:
        release(trainer)
        model.zero_grad(set_to_none=True)
        free_memory()


def section_train(ctx: Ctx) -> dict[str, Any]:
    names, skipped = methods(ctx)
    # the most informative plans first: the tight budget, the long sequence; every method gets its turn
    order = [(method, ckpt, seq, budget) for budget in ctx.s.budgets for seq in ctx.s.seqs
             for method in names for ckpt in (False, True)]
    if ctx.s.grid2 is not None:
        order = [(m, c, q, ctx.s.budgets[b]) for m, c, q, b in ctx.s.grid2]
    if ctx.s.plans3 is not None:
        order = order[:ctx.s.plans3]
    rows, not_run, durations = [], [], []
    models: dict[str, Any] = {}
    failed: dict[str, str] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu3_") as tmp:
            for k, (method, ckpt, seq, budget) in enumerate(order):
                name = f"{method}{'+ckpt' if ckpt else ''}"
                if ctx.clock.out(typical(durations)):
                    not_run.append({"config": name, "seq_len": seq, "budget": budget_label(budget),
                                    "reason": "time limit"})
                    continue
                started = time.monotonic()
                row = {"config": name, "seq_len": seq, "budget": budget_label(budget)}
                if method in failed:
                    rows.append({**row, "error": failed[method]})
                    continue
                if method not in models:
                    for other in list(models):  # one model on the device at a time
                        release(models.pop(other))
                    try:
                        models[method] = ctx.method_model(method)
                    except Exception as exc:  # e.g. a bitsandbytes that imports but cannot quantize here
                        failed[method] = f"building the model: {_error(exc)}"
                        rows.append({**row, "error": failed[method]})
                        free_memory()
                        continue
                model = models[method]
                try:
                    row.update(train_at_plan(ctx, model, ckpt, seq, budget, ctx.s.steps3, ctx.s.target3,
                                             os.path.join(tmp, str(k))))
                except Exception as exc:  # a failed plan is a finding: record it, go on
                    row["error"] = _error(exc)
                    free_memory()
                finally:
                    set_checkpointing(model, False)
                durations.append(time.monotonic() - started)
                rows.append(row)
                print(f"  [3] {name} s{seq} {row['budget']}: " + (row.get("error") or (
                    f"{row['plan'].get('describe')}, {row['steps']} steps, OOMs {row['oom_warnings']}, peak "
                    f"{_mib(row['peak_bytes'])} / budget {_mib(row['budget_bytes'])}")), flush=True)
    finally:
        for model in models.values():
            release(model)
        models.clear()
        free_memory()
    done = [r for r in rows if "steps" in r]
    ooms = sum(r["oom_warnings"] + (r["allocator_ooms"] or 0) for r in done)
    over = [r["peak_over_budget"] for r in done if r.get("peak_over_budget") is not None]
    goals = [goal("OOMs seen while training at the plans", ooms, "0", ooms == 0 if done else None),
             goal("peak / budget (worst)", max(over) if over else None, "<= 1", max(over) <= 1 if over else None),
             goal("plans that failed to train", sum("error" in r for r in rows), "0",
                  not any("error" in r for r in rows) if rows else None)]
    return {"figures": {"rows": rows, "not_run": not_run, "skipped": skipped}, "goals": goals,
            "partial": bool(not_run)}
