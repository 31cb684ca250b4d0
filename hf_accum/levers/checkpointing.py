"""Gradient checkpointing per layer, the first lever: what the user asked for, refused when the model cannot, the
levels the tuner may choose from (k of the L decoder layers recompute in the backward), and k applied to the model.
transformers' own flags and hooks are touched only through `compat.gradient_checkpointing`.

Requests (`args.AccumTrainingArguments.checkpoint_layers`, ``levers="checkpointing=K"`` and the boolean flag):
"auto" (the tuner measures and chooses k, `probing.level_choice`; without the tuner: off), an int k (exactly the first
k decoder layers), True/False (every layer / none, transformers' own switch, obeyed as given). The plan records
``{"layers": k, "of": L}`` (with ``"pinned": true`` when the user set it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..compat import deepspeed_integration, gradient_checkpointing, parallel
from ..config.settings import Settings
from .base import pin

logger = logging.getLogger(__name__)

NAME = "checkpointing"


# --- the request --------------------------------------------------------------------------------------------------
def parse_layers(value: Any, name: str = "checkpoint_layers") -> str | int | None:
    """A ``checkpoint_layers`` value as given (args, ``levers=``, the command line): "auto", an int k >= 0, or None
    (unset); ValueError naming ``name`` and the fix otherwise. The one check of the value's form."""
    setting = value
    if isinstance(value, str):
        text = value.strip().lower()
        setting = "auto" if text == "auto" else int(text) if text.isdigit() else None if text in (
            "", "none", "null") else False
        if text == "off":
            setting = 0
    if setting is None or setting == "auto":
        return setting
    if not isinstance(setting, int) or isinstance(setting, bool) or setting < 0:
        raise ValueError(f"{name}={value!r} must be 'auto' or an integer >= 0 (the number of decoder layers that "
                         "recompute). For every layer or none use gradient_checkpointing=True/False.")
    return setting


def check_layers(want: int, levels: int, model_name: str, per_layer: bool, asked: str) -> None:
    """``want`` checkpointed layers on a model with ``levels`` of them: ValueError naming ``asked`` and the fix when
    it has fewer. The one check of the value's range."""
    if want <= levels:
        return
    what = (f"{levels} checkpointable decoder layers" if per_layer else
            "no per-layer checkpointing (transformers' GradientCheckpointingLayer): on (1) or off (0) only")
    raise ValueError(f"{asked}, but {model_name} has {what}. Set checkpoint_layers to at most {levels}, 'auto', or "
                     "gradient_checkpointing=True for every layer.")


def checkpointing_enabled(args) -> bool:
    """Gradient checkpointing asked for, under either name (5.23 renamed it "activation checkpointing")."""
    flag = Settings(args).checkpointing_flag()
    return bool(flag)


def checkpoint_kwargs(args) -> dict:
    """The user's checkpointing kwargs for `torch.utils.checkpoint` (either name), without transformers' own keys."""
    settings = Settings(args)
    kwargs = settings.activation_checkpointing_kwargs or settings.gradient_checkpointing_kwargs or {}
    return {k: v for k, v in dict(kwargs).items() if k not in ("every_n_layers", "offload")}


def requested(args) -> str | int | bool:
    """"auto", k, or True/False; plain `TrainingArguments`: the flag. ``levers="checkpointing=K"`` is K."""
    pinned = pin(args, NAME)
    if pinned is not None:
        return parse_layers(pinned, "levers: checkpointing")
    setting = Settings(args).checkpoint_layers
    return setting if setting is not None else checkpointing_enabled(args)


def check_request(model, args) -> None:
    """Checkpointing asked for (True or k > 0) on a model that cannot: one error naming the class and what to set,
    at trainer construction, before any probe."""
    want = requested(args)
    if want is False or want == "auto" or want == 0:
        return
    name = type(model).__name__
    levels = gradient_checkpointing.checkpoint_levels(model)
    asked = "gradient_checkpointing=True" if want is True else f"checkpoint_layers={want}"
    if levels == 0:
        raise ValueError(
            f"{asked}, but {name} cannot checkpoint activations (it has no activation_checkpointing_enable / "
            "gradient_checkpointing_enable, or declares supports_gradient_checkpointing=False). Leave "
            "gradient_checkpointing and checkpoint_layers unset (or False / 0), or give the model that method."
        )
    if want is not True:
        check_layers(want, levels, name, bool(gradient_checkpointing.checkpointable_layers(model)), asked)


def enable_checkpointing(model, args) -> None:
    """Turn on gradient checkpointing as `Trainer.train()` will, so a probe that runs before `train()` measures
    the memory training will use. Idempotent."""
    if checkpointing_enabled(args):
        gradient_checkpointing.enable_all(model, checkpoint_kwargs(args))


def apply_requested(model, args) -> None:
    """Before a probe or training: an explicit request set on the model (True as `Trainer.train()` will set it, so a
    probe before it measures the same; k exactly). "auto" and False leave the model as it is."""
    want = requested(args)
    if want is True:
        enable_checkpointing(model, args)
    elif isinstance(want, int) and not isinstance(want, bool) and gradient_checkpointing.checkpoint_levels(model):
        gradient_checkpointing.set_checkpointed_layers(model, want, checkpoint_kwargs(args))


def apply_chosen(model, k: int, args) -> None:
    """The tuner's choice (a plan's checkpointed layers) set on the model; idempotent."""
    gradient_checkpointing.set_checkpointed_layers(model, k, checkpoint_kwargs(args))


# --- the levels ---------------------------------------------------------------------------------------------------
@dataclass
class Levels:
    """What the probe needs to try levels: L (`gradient_checkpointing.checkpoint_levels`) and a context that sets k
    for a trial; anchors 0 and L."""

    model: object
    num_layers: int
    kwargs: dict
    name: str = NAME

    @property
    def count(self) -> int:
        return self.num_layers

    @property
    def anchors(self) -> tuple[int, ...]:
        return (0, self.num_layers)

    def at(self, k: int):
        return gradient_checkpointing.checkpointed_layers(self.model, k, self.kwargs)

    def record(self, k: int) -> dict[str, Any]:
        return {"layers": int(k), "of": int(self.num_layers)}


Lever = Levels  # the name the probe's callers knew (cli, the benchmark)


def lever_for(trainer) -> Levels | None:
    """The levels when the tuner may choose k: "auto", a model that can checkpoint, no DeepSpeed / FSDP (one log line
    says the lever is skipped there: today's behaviour, no checkpointing unless asked)."""
    args, model = trainer.args, trainer.model
    if requested(args) != "auto" or not Settings(args).tunes:
        return None
    engine = sharded_engine(trainer)
    if engine is not None:
        logger.warning("hf_accum: checkpoint_layers='auto' is not chosen by the probe under %s: checkpointing stays "
                       "off (set gradient_checkpointing=True for every layer, or checkpoint_layers=K).", engine)
        return None
    levels = gradient_checkpointing.checkpoint_levels(model)
    if levels == 0:
        logger.info("hf_accum: %s cannot checkpoint activations; the probe plans without checkpointing.",
                    type(model).__name__)
        return None
    return Levels(model, levels, checkpoint_kwargs(args))


def sharded_engine(trainer) -> str | None:
    if deepspeed_integration.deepspeed_stage(trainer) is not None:
        return "DeepSpeed"
    if (parallel.is_fsdp2(trainer.model) or parallel.sharded_at_load(trainer.model)
            or getattr(trainer, "is_fsdp_enabled", False)):
        return "FSDP"
    return None


# --- the plug-in --------------------------------------------------------------------------------------------------
class CheckpointingLever:
    """The registry's entry: the functions above behind `base.Lever`."""

    name = NAME
    replaces: tuple[str, ...] = ()

    requested = staticmethod(requested)

    @staticmethod
    def parse_pin(value: str) -> str | int:
        return parse_layers(value, "levers: checkpointing")
    check = staticmethod(check_request)
    apply_requested = staticmethod(apply_requested)

    @staticmethod
    def levels(trainer) -> Levels | None:
        return lever_for(trainer)

    @staticmethod
    def pinned_record(model, args) -> dict[str, Any] | None:
        want = requested(args)
        levels = gradient_checkpointing.checkpoint_levels(model)
        if want == "auto" or want is False or not levels:
            return None
        return {"layers": levels if want is True else int(want), "of": levels, "pinned": True}

    @staticmethod
    def apply(model, record: dict[str, Any], args) -> None:
        if not record.get("pinned"):  # a pinned level is the request, set by apply_requested / Trainer.train
            apply_chosen(model, record["layers"], args)

    @staticmethod
    def describe(record: dict[str, Any]) -> str:
        return f"checkpointing {record['layers']} of {record['of']} layers" + (" (as set)" if record.get("pinned")
                                                                               else "")

    @staticmethod
    def figures(record: dict[str, Any]) -> dict[str, Any]:
        return {"hf_accum/checkpointed_layers": record["layers"], "hf_accum/num_layers": record["of"]}
