"""Section 4, oom: a real out-of-memory error mid-run (on CPU an injected one): the run recovers with the same effective batch."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from hf_accum.probing.plan import divisors

from .context import Ctx, MiB, plan_facts, release
from .data import PadCollator, budget_kwargs, goal, lm_rows, make_trainer, oom_log, peak_at_one


# --- section 4: a real OOM mid-run ----------------------------------------------------------------------------------
def memory_between(result, micro: int, smaller: int) -> float:
    """Memory (charged bytes) halfway between a step of ``smaller`` rows and one of ``micro`` rows, from the probe:
    its fitted line, or, with one measured size, a step's growth above what it starts with, proportional to rows."""
    if result.fitted is not None:
        a, b = result.fitted
        return a + b * (micro + smaller) / 2
    trial = max((t for t in result.trials if t.fits and t.peak_bytes), key=lambda t: t.micro_batch_size)
    top, base = trial.reserved_bytes or trial.peak_bytes, trial.baseline_bytes or 0
    return base + (top - base) * (micro + smaller) / 2 / trial.micro_batch_size


class Grab:
    """Before the window of step ``at``, takes device memory so the plan's micro-batch no longer fits but the next
    smaller one does (from the probe's memory line); keeps it to the end, as another process would. On CPU a real
    OOM kills the process, so there the next training forward raises torch.OutOfMemoryError instead."""

    def __new__(cls, ctx: Ctx, trainer, at: int):
        from transformers import TrainerCallback

        class _Grab(TrainerCallback):
            def __init__(self):
                self.held = None
                self.grabbed_bytes = 0
                self.armed = False
                self.fired = 0
                self.kind = "real (torch.empty holding device memory)" if ctx.cuda else (
                    "injected torch.OutOfMemoryError (CPU: a real OOM would kill the process)")
                self.hook = trainer.model.register_forward_pre_hook(self._raise)

            def _raise(self, module, args):
                if self.armed and module.training:
                    self.armed = False
                    self.fired += 1
                    raise torch.OutOfMemoryError("CPU out of memory (injected by bench_gpu section 4)")

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step != at or self.held is not None or self.armed:
                    return
                if not ctx.cuda:
                    self.armed = True
                    return
                facts = plan_facts(trainer.plan)
                m = int(facts["rows_per_forward_effective"])
                target = int(facts["target_batch_size"]) // int(facts["world_size"])
                smaller = max([d for d in divisors(target) if d < m] or [1])
                mid = memory_between(trainer.probe_result, m, smaller)
                free, _ = torch.cuda.mem_get_info(ctx.device)
                want = max(0, int(free + torch.cuda.memory_reserved(ctx.device) - mid))
                while want > 0 and self.held is None:  # what the allocator can hand out may be a little less
                    try:
                        self.held = torch.empty(want, dtype=torch.uint8, device=ctx.device)
                        self.grabbed_bytes = want
                    except torch.OutOfMemoryError:
                        want = int(want * 0.97) - 64 * MiB

            def on_train_end(self, args, state, control, **kwargs):
                self.held = None
                self.hook.remove()

        return _Grab()


def section_oom(ctx: Ctx) -> dict[str, Any]:
    from transformers import TrainerCallback

    s = ctx.s
    seq = min(ctx.s.seqs)
    model = ctx.llama()
    collator = PadCollator()
    rows = lm_rows([seq] * (s.steps4 * s.target4), s.model["vocab_size"], seed=4)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu4_") as tmp:
            budget = ("fraction", 0.9) if ctx.cuda else ("x_peak1", 12.0)
            kw = budget_kwargs(ctx, budget, lambda: peak_at_one(ctx, model, seq))
            trainer = make_trainer(ctx, model, rows, tmp, collator=collator, target_batch_size=s.target4,
                                   max_steps=s.steps4, **kw)
            before = plan_facts(trainer.tune())
            grab = Grab(ctx, trainer, at=2)
            trainer.add_callback(grab)
            # the probe and the checks before it collate rows too: count only what the training loop loads
            trainer.add_callback(type("CountFromHere", (TrainerCallback,), {
                "on_train_begin": lambda self, args, state, control, **kw: collator.seen.clear()})())
            ooms_before = ctx.num_ooms()
            with oom_log() as log:
                trainer.train()
            after = plan_facts(trainer.plan)
            seen = collator.seen
            figures = {
                "seq_len": seq, "oom_kind": grab.kind, "grabbed_bytes": grab.grabbed_bytes if ctx.cuda else None,
                "plan_before": before, "plan_after": after, "oom_warnings": log.messages,
                "allocator_ooms": None if ooms_before is None else ctx.num_ooms() - ooms_before,
                "steps": trainer.state.global_step, "max_steps": s.steps4, "samples_loaded": len(seen),
                "distinct_samples": len(set(seen)), "expected_samples": s.steps4 * s.target4,
            }
            release(trainer, grab)
    finally:
        release(model)
    recovered = (figures["steps"] == s.steps4 and after.get("effective_batch") == before.get("effective_batch")
                 == s.target4 and figures["samples_loaded"] == figures["distinct_samples"] == s.steps4 * s.target4)
    smaller = (after.get("rows_per_forward_effective") or 0) < (before.get("rows_per_forward_effective") or 0)
    goals = [goal("an OOM happened mid-run", len(figures["oom_warnings"]), ">= 1", len(figures["oom_warnings"]) >= 1),
             goal("recovered: all steps, same effective batch, every sample once", recovered, "true", recovered),
             goal("micro-batch lowered after the OOM", f"{before.get('rows_per_forward_effective')} -> "
                  f"{after.get('rows_per_forward_effective')}", "smaller", smaller)]
    return {"figures": figures, "goals": goals}
