"""The plan in a DeepSpeed config: the three batch fields DeepSpeed builds its engine from.

DeepSpeed requires ``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world``.
hf_accum's plan is micro × accumulation × world = target, so each field has exactly one value: ``"auto"`` (or a
missing field) is filled from the plan by transformers (`HfTrainerDeepSpeedConfig.trainer_config_process`, run
on the arguments the plan set); an explicit value must equal the plan's, or the run is refused before any work,
naming the field and the fix. Pure: a config dict and numbers in, a message out.
"""

from __future__ import annotations

from typing import Any

BATCH_FIELDS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def plan_fields(micro: int, accumulation: int, world: int | None) -> dict[str, int]:
    """The values DeepSpeed's batch fields take under the plan micro × accumulation × world (``world`` None: the
    per-rank fields only, before the world size is known)."""
    fields = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation}
    if world is not None:
        fields["train_batch_size"] = micro * accumulation * world
    return fields


def batch_contradiction(config: dict[str, Any], micro: int, accumulation: int, world: int | None,
                        plan: str) -> str | None:
    """The one-line error for the first explicit batch field of ``config`` that contradicts the plan (described as
    ``plan``, e.g. "micro 2 × accumulation 2 × world 2 = 8"); None when every field is "auto", absent or equal."""
    for key, value in plan_fields(micro, accumulation, world).items():
        given = config.get(key)
        if given is None or given == "auto" or given == value:
            continue
        return (
            f"deepspeed config {key}={given!r} contradicts hf_accum's plan ({plan}), which needs {key}={value}. "
            f'Set "{key}": "auto" in the DeepSpeed config (hf_accum fills it from the plan) or {value}.'
        )
    return None


def zero_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage a config asks for (0 when it has no ``zero_optimization.stage``)."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    return int(stage) if isinstance(stage, int) or str(stage).isdigit() else 0

