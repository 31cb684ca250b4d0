"""What a recipe run reports: `run_summary.json` (the plan, the probe's figures, tokens, losses, versions) and the
plan as every line shows it. The probe's figures come from the trainer, or from the plan file through the store.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..planning.store import library_version, stored_probe
from ..probing.plan import Plan


def describe(plan: dict[str, Any]) -> str:
    """The plan as every line shows it (`Plan.describe`)."""
    return Plan(**plan).describe()

def run_summary(built, result, plan: dict[str, Any], resume: str | None, cuda_peak: int | None,
             start: float, started) -> dict[str, Any]:
    """What `run_summary.json` holds."""
    recipe, args, trainer, data = built.recipe, built.args, built.trainer, built.data
    per_step = plan["target_batch_size"]
    probe = _probe_summary(trainer, plan["micro_batch_size"])
    train_seconds = result.metrics.get("train_runtime")
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h and "step" in h]
    rewards = [(h["step"], h["reward"]) for h in trainer.state.log_history if "reward" in h and "step" in h]  # GRPO
    steps_this_run = trainer.state.global_step - started.step
    tokens = (getattr(trainer.state, "num_input_tokens_seen", 0) or 0) - started.tokens or None
    if tokens is None:  # include_num_input_tokens_seen is off: estimate from the data
        tokens = round(steps_this_run * per_step * data.mean_tokens)
    return {
        "recipe": recipe.name,
        "recipe_path": recipe.path,
        "plan": plan,
        "plan_description": describe(plan),
        "reused_stored_plan": bool(probe.get("reused_stored_plan")),
        "resumed_from": resume,
        "tokens_per_optimizer_step": per_step * data.mean_tokens,
        "targets_per_optimizer_step": per_step * data.mean_targets,
        "loss_normalization": args.loss_normalization,
        "peak_memory_bytes": probe.get("peak_bytes"),
        "probe": probe,
        "training_peak_memory_bytes": cuda_peak,
        "training_peak_memory_note": _training_peak_note(cuda_peak),
        "trainable_parameters": built.trainable,
        "total_parameters": built.total,
        "examples": len(data.dataset),
        "steps": trainer.state.global_step,
        "steps_this_run": steps_this_run,
        "tokens_seen": tokens,
        "train_seconds": train_seconds,
        "tokens_per_second": tokens / train_seconds if train_seconds else None,
        "train_loss": result.metrics.get("train_loss"),  # mean over the steps of this call
        "first_loss": losses[0][1] if losses else None,
        "last_loss": losses[-1][1] if losses else None,
        "losses": [{"step": s, "loss": v} for s, v in losses],
        **_reward_summary(rewards),
        "wall_seconds": time.perf_counter() - start,
        "output_dir": os.path.abspath(args.output_dir),
        "config": recipe.to_dict(),
        "versions": _versions(),
    }

def _reward_summary(rewards: list[tuple[int, float]]) -> dict[str, Any]:
    """GRPO: the mean reward of each logged step, and its mean over the first and the last 10 of them."""
    if not rewards:
        return {}
    values = [v for _, v in rewards]
    return {"rewards": [{"step": s, "reward": v} for s, v in rewards],
            "first_rewards_mean": sum(values[:10]) / len(values[:10]),
            "last_rewards_mean": sum(values[-10:]) / len(values[-10:])}


def _probe_summary(trainer, micro: int) -> dict[str, Any]:
    """What the probe measured (this run, or the run whose stored plan was reused), and the peak at ``micro``."""
    if trainer.probe_result is not None:
        probe, reused = trainer.probe_result.to_dict(), False
    else:
        probe, reused = stored_probe(trainer.args.output_dir), True
        if probe is None:
            return {}
    trials = [
        {k: t.get(k) for k in ("micro_batch_size", "peak_bytes", "seconds", "status")} for t in probe.get("trials", [])
    ]
    out = {
        "reused_stored_plan": reused,
        "device": probe.get("device"),
        "budget_bytes": probe.get("budget_bytes"),
        "max_micro_batch_size": probe.get("max_micro_batch_size"),
        "trials": trials,
        "peak_bytes": None,
        "peak_source": None,
    }
    measured = [t for t in trials if t["micro_batch_size"] == micro and t["peak_bytes"] is not None]
    fitted = probe.get("fitted")
    if measured:
        out["peak_bytes"], out["peak_source"] = measured[0]["peak_bytes"], f"measured by the probe at micro {micro}"
    elif fitted:
        out["peak_bytes"] = int(fitted["a_bytes"] + fitted["b_bytes_per_sample"] * micro)
        out["peak_source"] = "the probe's line through its measurements"
    return out

def _training_peak_note(cuda_peak: int | None) -> str:
    """Where training_peak_memory_bytes comes from, or why it is null."""
    if cuda_peak is not None:
        return "torch.cuda.max_memory_allocated over train()"
    return ("not measured off CUDA: the CPU meter replays the profiler's allocation events, which is for the probe's "
            "single steps (profiling every step would slow the run many times); peak_memory_bytes is the probe's "
            "figure at the plan's micro-batch")

def _versions() -> dict[str, str | None]:
    return {name: library_version(name) for name in ("hf-accum", "torch", "transformers", "peft", "bitsandbytes", "trl")}
