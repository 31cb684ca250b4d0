"""The engines a trainer runs on, behind one seam (`base.Engine`): one process (the default), DDP, FSDP, DeepSpeed.
`select(trainer)` is the one place that asks which engine runs; everything else calls the engine it returns
(`AccumulationMixin.engine`)."""

from __future__ import annotations

from . import deepspeed, fsdp
from .base import Engine
from .ddp import Ddp


def select(trainer) -> Engine:
    """The engine that runs ``trainer`` (refusing a launch whose engine would silently differ from the one asked)."""
    from ...compat import deepspeed_integration, parallel

    parallel.refuse_silent_engine_fallback(trainer)
    deepspeed_integration.refuse_zero3_float64(trainer)
    if deepspeed.runs(trainer):
        return deepspeed.DeepSpeed(trainer)
    if fsdp.runs(trainer):
        return fsdp.Fsdp(trainer)
    if trainer.accelerator.num_processes > 1:
        return Ddp(trainer)
    return Engine(trainer)


__all__ = ["Engine", "select"]
