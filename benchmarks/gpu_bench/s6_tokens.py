"""Section 6, tokens: micro_batching tokens vs samples on long-tailed lengths, and the fused loss on vs off."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from hf_accum.probing.meters import CpuMeter, live_tensor_bytes
from hf_accum.probing.probe import make_step_fn, random_token_batch
from hf_accum.window.oom import free_memory, is_oom

from .context import Ctx, plan_facts, release, typical
from .data import StepTimes, budget_kwargs, goal, lm_rows, long_tailed_lengths, make_trainer, oom_log, peak_at_one


# --- section 6: token budgets and the fused loss -----------------------------------------------------------------
class ForwardCount:
    """Training forwards of a model and the token positions they held."""

    def __init__(self, model) -> None:
        self.forwards = self.tokens = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if module.training:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.forwards += 1
            self.tokens += int(ids.numel()) if torch.is_tensor(ids) else 0

    def remove(self) -> None:
        self.handle.remove()


def fused_step(ctx: Ctx, model, seq: int, micro: int, on: bool) -> dict[str, Any]:
    """One training step's charged peak and its median time (3 unprofiled runs), the fused loss on or off."""
    from hf_accum.levers.kernels import fused_loss as fl

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = make_step_fn(model, opt, random_token_batch(model, seq))
    meter = ctx.meter(model, opt)
    with fl.fused_lm_loss(model) if on else contextlib.nullcontext():
        try:
            step(micro)
            m = meter.measure(lambda: step(micro))
            secs = statistics.median(meter.time(lambda: step(micro)) for _ in range(3))
            return {"peak_bytes": m.charged_bytes, "seconds_per_step": secs}
        except Exception as exc:
            if not is_oom(exc):
                raise
            return {"out_of_memory": True}
        finally:
            opt.state.clear()
            model.zero_grad(set_to_none=True)
            free_memory()


def section_tokens(ctx: Ctx) -> dict[str, Any]:
    from hf_accum.levers.kernels import fused_loss as fl

    s = ctx.s
    seq, target, steps = s.seq6, s.target6, s.steps6
    lengths = long_tailed_lengths(steps * target, seq, seed=6, every_longest=32)
    rows = lm_rows(lengths, s.model["vocab_size"], seed=6)
    model = ctx.llama()
    figures: dict[str, Any] = {"seq_len": seq, "target": target, "steps": steps, "real_tokens": sum(lengths),
                               "lengths": {"median": statistics.median(lengths), "longest": max(lengths)}}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu6_") as tmp:
            budget = ("fraction", 0.9) if ctx.cuda else ("x_peak1", 4.0)
            kw = budget_kwargs(ctx, budget, lambda: peak_at_one(ctx, model, seq))
            modes, durations = {}, []
            for mode in ("samples", "tokens"):
                started = time.monotonic()
                if ctx.clock.out(typical(durations)) and modes:
                    figures["modes_cut_short"] = True
                    break
                timer = StepTimes(ctx)
                # both modes at one checkpointing level (none): the lever chooses per mode, by measured time, and a
                # different level in each would confound the padding and time this section compares
                trainer = make_trainer(ctx, model, rows, os.path.join(tmp, mode), callbacks=[timer],
                                       target_batch_size=target, max_steps=steps, micro_batching=mode,
                                       gradient_checkpointing=False, **kw)
                try:
                    start = time.perf_counter()
                    plan = trainer.tune()
                    probe_s = time.perf_counter() - start
                    count = ForwardCount(model)
                    ctx.reset_peak()
                    with oom_log() as log:
                        if ctx.cuda:
                            trainer.train()
                            peak = ctx.peak_reserved()
                        else:
                            peak = CpuMeter(resident=lambda: live_tensor_bytes(model)).measure(trainer.train).peak_bytes
                    count.remove()
                    budget_bytes = trainer.probe_result.budget_bytes if trainer.probe_result else None
                    modes[mode] = {
                        "plan": plan_facts(plan), "probe_seconds": probe_s, "probe_trials":
                        len(trainer.probe_result.measured_trials) if trainer.probe_result else None,
                        "forwards_per_step": count.forwards / max(1, trainer.state.global_step),
                        "padded_over_real_tokens": count.tokens / figures["real_tokens"],
                        "seconds_per_step": timer.steady(skip=1), "peak_bytes": peak, "budget_bytes": budget_bytes,
                        "peak_over_budget": peak / budget_bytes if peak and budget_bytes else None,
                        "oom_warnings": len(log.messages),
                    }
                finally:
                    release(trainer)
                    model.zero_grad(set_to_none=True)
                    durations.append(time.monotonic() - started)
            figures["modes"] = modes
            # the fused loss on vs off at one micro-batch: a step's peak and its time
            micro = s.micro6
            fused: dict[str, Any] = {"micro": micro, "seq_len": seq, "vocab": s.model["vocab_size"],
                                     "implementation": fl._describe_implementation()}
            for on in (False, True):
                if ctx.clock.out() and len(fused) > 4:
                    fused["cut_short"] = True
                    break
                fused["on" if on else "off"] = fused_step(ctx, model, seq, micro, on)
            on, off = fused.get("on", {}), fused.get("off", {})
            if on.get("peak_bytes") and off.get("peak_bytes"):
                fused["peak_ratio"] = on["peak_bytes"] / off["peak_bytes"]
                fused["time_ratio"] = on["seconds_per_step"] / off["seconds_per_step"]
            figures["fused_loss"] = fused
    finally:
        release(model)
    modes = figures.get("modes", {})
    worst = [m["peak_over_budget"] for m in modes.values() if m.get("peak_over_budget") is not None]
    both = "tokens" in modes and "samples" in modes
    fewer = modes["tokens"]["forwards_per_step"] / modes["samples"]["forwards_per_step"] if both else None
    padding = (modes["tokens"]["padded_over_real_tokens"] / modes["samples"]["padded_over_real_tokens"]
               if both else None)
    ratio = figures.get("fused_loss", {}).get("peak_ratio")
    goals = [goal("peak / budget in both modes (worst)", max(worst) if worst else None, "<= 1",
                  max(worst) <= 1 if worst else None),
             goal("tokens-mode padded tokens over samples-mode", padding, "<= 1", padding <= 1 if padding else None),
             goal("tokens-mode forwards per step over samples-mode", fewer, "info", None),
             goal("fused-loss peak over unfused at equal micro", ratio, "< 1", ratio < 1 if ratio else None)]
    return {"figures": figures, "goals": goals}
