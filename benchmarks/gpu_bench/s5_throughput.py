"""Section 5, throughput: tokens/s at the plan vs the best divisor vs micro 1, MFU, AccumTrainer / Trainer step time."""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

import torch

from hf_accum.probing import flops
from hf_accum.probing.plan import divisors

from .context import Ctx, plan_facts, release
from .data import StepTimes, budget_kwargs, goal, lm_rows, make_trainer, peak_at_one


# --- section 5: throughput ------------------------------------------------------------------------------------------
def timed_run(ctx: Ctx, model, rows, out: str, *, accum_trainer: bool = True, **kwargs) -> tuple[float | None, Any]:
    timer = StepTimes(ctx)
    trainer = make_trainer(ctx, model, rows, out, accum_trainer=accum_trainer, callbacks=[timer],
                           max_steps=ctx.s.warm5 + ctx.s.timed5, **kwargs)
    try:
        trainer.train()
        plan = getattr(trainer, "plan", None)
        return timer.steady(skip=ctx.s.warm5), plan
    finally:
        release(trainer)
        model.zero_grad(set_to_none=True)


def section_throughput(ctx: Ctx) -> dict[str, Any]:
    s = ctx.s
    seq, target = s.seq5, s.target5
    model = ctx.llama()
    rows = lm_rows([seq] * ((s.warm5 + s.timed5) * target), s.model["vocab_size"], seed=5)
    tokens_per_step = seq * target
    per_token = flops.training_flops_per_token(model, seq)
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    peak = flops.bf16_peak_flops(device_name) if ctx.cuda else None
    figures: dict[str, Any] = {"config": "full, AdamW, no checkpointing", "seq_len": seq, "target": target,
                               "flops_per_token": per_token, "device": device_name, "bf16_peak_flops": peak}
    if peak is None:
        figures["mfu_null_reason"] = ("CPU run (--quick): no bf16 tensor-core peak" if not ctx.cuda
                                      else f"no bf16 peak in hf_accum.probing.flops.BF16_PEAK_TFLOPS for {device_name!r}")
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu5_") as tmp:
            budget = ("fraction", 0.9) if ctx.cuda else ("x_peak1", 6.0)
            kw = budget_kwargs(ctx, budget, lambda: peak_at_one(ctx, model, seq))
            secs, plan = timed_run(ctx, model, rows, os.path.join(tmp, "plan"), target_batch_size=target, **kw)
            facts = plan_facts(plan)
            chosen = int(facts["rows_per_forward_effective"])
            figures["plan"] = facts
            by_micro: dict[int, float] = {}
            figures["plan_seconds_per_step"] = secs
            figures["plan_tokens_per_second"] = tokens_per_step / secs if secs else None
            # the sweep of divisors: micro 1 and the plan's neighbours first, the rest while time is left
            order = [1, *sorted((d for d in divisors(target) if 1 < d <= chosen), key=lambda d: -d)]
            if s.sweep5 is not None:
                order = order[:s.sweep5]
            for micro in order:
                if ctx.clock.out(need=10.0 if ctx.cuda else 0.0):
                    figures["sweep_cut_short"] = True
                    break
                t, _ = timed_run(ctx, model, rows, os.path.join(tmp, f"m{micro}"), target_batch_size=target,
                                 per_device_train_batch_size=micro, gradient_accumulation_steps=target // micro,
                                 auto_tune=False)
                if t:
                    by_micro[micro] = tokens_per_step / t
            figures["tokens_per_second_by_micro"] = by_micro
            timed = dict(by_micro)
            if figures["plan_tokens_per_second"] and chosen not in timed:
                timed[chosen] = figures["plan_tokens_per_second"]  # the plan's own run is a point of the sweep
            best = max(timed.items(), key=lambda kv: kv[1]) if timed else (None, None)
            figures["sweep_best"] = {"micro": best[0], "tokens_per_second": best[1]}
            plan_tps = figures["plan_tokens_per_second"]
            figures["plan_over_best"] = plan_tps / best[1] if plan_tps and best[1] else None
            figures["plan_over_micro1"] = plan_tps / by_micro[1] if plan_tps and by_micro.get(1) else None
            figures["mfu_plan"] = flops.mfu(plan_tps or 0.0, per_token, peak)
            figures["mfu_best"] = flops.mfu(best[1] or 0.0, per_token, peak)
            # AccumTrainer / Trainer at the same micro x accumulation, interleaved; the fused loss off so both
            # compute the same thing (the overhead measured is the window engine's)
            micro = max(d for d in divisors(target) if d <= chosen)
            ratios, pairs = [], []
            for r in range(s.rounds5):
                if ctx.clock.out(need=5.0 if ctx.cuda else 0.0) and ratios:
                    figures["overhead_cut_short"] = True
                    break
                times = {}
                for cls in (("plain", "accum") if r % 2 == 0 else ("accum", "plain")):
                    extra = {"fused_loss": False, "target_batch_size": target} if cls == "accum" else {}
                    times[cls], _ = timed_run(ctx, model, rows, os.path.join(tmp, f"o{r}{cls}"),
                                              accum_trainer=cls == "accum", per_device_train_batch_size=micro,
                                              gradient_accumulation_steps=target // micro, **extra,
                                              **({"auto_tune": False} if cls == "accum" else {}))
                if times["plain"] and times["accum"]:
                    ratios.append(times["accum"] / times["plain"])
                    pairs.append(times)
            figures["overhead"] = {"micro": micro, "accumulation": target // micro, "rounds": pairs,
                                   "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None}
    finally:
        release(model)
    ratio = figures["overhead"]["median_ratio"] if "overhead" in figures else None
    goals = [goal("AccumTrainer / Trainer step time (median of interleaved rounds)", ratio, "<= 1.01",
                  ratio <= 1.01 if ratio is not None else None),
             goal("plan tokens/s over the sweep's best", figures.get("plan_over_best"), "info", None),
             goal("plan tokens/s over micro 1", figures.get("plan_over_micro1"), "info", None),
             goal("MFU at the plan", figures.get("mfu_plan"), "info", None)]
    return {"figures": figures, "goals": goals}
