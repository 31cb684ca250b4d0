"""The checkpointing setting as the trainer applies it: what the user asked for, refused when the model cannot, the
levels the tuner may choose from, and k applied to the model (`gradient_checkpointing.set_checkpointed_layers`).

Requests (args.AccumTrainingArguments.checkpoint_layers and the boolean flag): "auto" (the tuner measures and chooses
k, levers.py; without the tuner: off), an int k (exactly the first k decoder layers), True/False (every layer / none,
transformers' own switch, obeyed as given).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .compat import deepspeed_integration, gradient_checkpointing, parallel
from .settings import Settings

logger = logging.getLogger(__name__)


def requested(args) -> str | int | bool:
    """"auto", k, or True/False; plain `TrainingArguments`: the flag."""
    setting = Settings(args).checkpoint_layers
    return setting if setting is not None else gradient_checkpointing.checkpointing_enabled(args)


def check_request(model, args) -> None:
    """Checkpointing asked for (True or k > 0) on a model that cannot: one error naming the class and what to set,
    at trainer construction, before any probe."""
    want = requested(args)
    if want is False or want == "auto" or want == 0:
        return
    name = type(model).__name__
    levels = gradient_checkpointing.checkpoint_levels(model)
    if levels == 0:
        asked = "gradient_checkpointing=True" if want is True else f"checkpoint_layers={want}"
        raise ValueError(
            f"{asked}, but {name} cannot checkpoint activations (it has no activation_checkpointing_enable / "
            "gradient_checkpointing_enable, or declares supports_gradient_checkpointing=False). Leave "
            "gradient_checkpointing and checkpoint_layers unset (or False / 0), or give the model that method."
        )
    if want is not True and want > levels:
        per_layer = (f"{levels} checkpointable decoder layers" if gradient_checkpointing.checkpointable_layers(model) else
                     "no per-layer checkpointing (transformers' GradientCheckpointingLayer): on (1) or off (0) only")
        raise ValueError(f"checkpoint_layers={want}, but {name} has {per_layer}. Set checkpoint_layers to at most "
                         f"{levels}, 'auto', or gradient_checkpointing=True for every layer.")


def apply_requested(model, args) -> None:
    """Before a probe or training: an explicit request set on the model (True as `Trainer.train()` will set it, so a
    probe before it measures the same; k exactly). "auto" and False leave the model as it is."""
    want = requested(args)
    if want is True:
        gradient_checkpointing.enable_checkpointing(model, args)
    elif isinstance(want, int) and not isinstance(want, bool) and gradient_checkpointing.checkpoint_levels(model):
        gradient_checkpointing.set_checkpointed_layers(model, want, gradient_checkpointing.checkpoint_kwargs(args))


def apply_chosen(model, k: int, args) -> None:
    """The tuner's choice (a plan's checkpointed_layers) set on the model; idempotent."""
    gradient_checkpointing.set_checkpointed_layers(model, k, gradient_checkpointing.checkpoint_kwargs(args))


@dataclass
class Lever:
    """What the probe needs to try levels: L (`gradient_checkpointing.checkpoint_levels`) and a context that sets k for a trial."""

    model: object
    num_layers: int
    kwargs: dict

    def at(self, k: int):
        return gradient_checkpointing.checkpointed_layers(self.model, k, self.kwargs)


def lever_for(trainer) -> Lever | None:
    """The lever when the tuner may choose k: "auto", a model that can checkpoint, no DeepSpeed / FSDP (one log line
    says the lever is skipped there: today's behaviour, no checkpointing unless asked)."""
    args, model = trainer.args, trainer.model
    if requested(args) != "auto" or not Settings(args).tunes:
        return None
    engine = _sharded_engine(trainer)
    if engine is not None:
        logger.warning("hf_accum: checkpoint_layers='auto' is not chosen by the probe under %s: checkpointing stays "
                       "off (set gradient_checkpointing=True for every layer, or checkpoint_layers=K).", engine)
        return None
    levels = gradient_checkpointing.checkpoint_levels(model)
    if levels == 0:
        logger.info("hf_accum: %s cannot checkpoint activations; the probe plans without checkpointing.",
                    type(model).__name__)
        return None
    return Lever(model, levels, gradient_checkpointing.checkpoint_kwargs(args))


def _sharded_engine(trainer) -> str | None:
    if deepspeed_integration.deepspeed_stage(trainer) is not None:
        return "DeepSpeed"
    if (parallel.is_fsdp2(trainer.model) or parallel.sharded_at_load(trainer.model)
            or getattr(trainer, "is_fsdp_enabled", False)):
        return "FSDP"
    return None
