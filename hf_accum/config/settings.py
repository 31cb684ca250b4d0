"""hf_accum's settings as the code reads them, from whatever arguments object a trainer got.

`AccumTrainingArguments` (and the TRL configs deriving from it) has every field below, checked in its
`__post_init__`; a plain `TrainingArguments` or TRL config has none of hf_accum's, and each then reads as the value
that means "hf_accum's default behaviour" (no target, no tuning, ...). That fallback is resolved here, in one place,
instead of a defensive lookup with a default at every site.

A view, not a copy: each field is read when asked for, because the trainer's own copy of the arguments changes after
construction (the planner writes the plan's batch fields; a recipe turns `auto_tune` off once it has planned;
`max_nonfinite_steps="auto"` is resolved for the engine) and a snapshot would go stale.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Field(Generic[T]):
    """One setting: the arguments' field of the same name, or ``default`` where the arguments have no such field."""

    def __init__(self, default: T):
        self.default = default

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, settings: Settings | None, owner=None) -> T:
        if settings is None:
            return self  # type: ignore[return-value]
        return getattr(settings.args, self.name, self.default)


class Settings:
    """Typed reads of hf_accum's settings on ``args`` (see the module docstring)."""

    # planning
    target_batch_size: _Field[int | None] = _Field(None)
    tunes: _Field[bool] = _Field(False)  # AccumTrainingArguments: auto_tune with a target
    micro_batching: _Field[str] = _Field("samples")
    memory_budget_bytes: _Field[int | None] = _Field(None)
    memory_budget: _Field[float] = _Field(0.9)
    auto_eval_batch_size: _Field[bool | None] = _Field(None)  # None: with auto_tune
    grow_back_steps: _Field[int] = _Field(16)  # after an OOM lowered the plan (growback.py)
    # levers
    checkpoint_layers: _Field[Any] = _Field(None)  # "auto", k, or None
    levers: _Field[str | None] = _Field(None)  # pinned levers, "name=value,..." (levers/base.py: parse_pins)
    activation_checkpointing: _Field[bool | None] = _Field(None)  # transformers >= 5.23; older: gradient_checkpointing
    activation_checkpointing_kwargs: _Field[dict | None] = _Field(None)
    gradient_checkpointing: _Field[bool | None] = _Field(None)
    gradient_checkpointing_kwargs: _Field[dict | None] = _Field(None)
    fused_loss: _Field[bool | None] = _Field(None)
    # the loss and the run
    loss_normalization: _Field[str | None] = _Field(None)  # None: not hf_accum's arguments (the trainer decides)
    label_smoothing_factor: _Field[float] = _Field(0)
    bf16: _Field[bool] = _Field(False)
    fp16: _Field[bool] = _Field(False)
    max_nonfinite_steps: _Field[int | None] = _Field(None)
    handle_preemption: _Field[bool] = _Field(False)
    check_accumulation: _Field[bool] = _Field(False)
    check_accumulation_tolerance: _Field[float | None] = _Field(None)

    def __init__(self, args):
        self.args = args

    def checkpointing_flag(self) -> bool | None:
        """The boolean checkpointing flag as given: activation_checkpointing (transformers >= 5.23) or its deprecated
        alias gradient_checkpointing; None when neither is set."""
        new = self.activation_checkpointing
        return new if new is not None else self.gradient_checkpointing

    def explicit_batch(self) -> dict[str, int]:
        """per_device_train_batch_size / gradient_accumulation_steps where they differ from their class defaults:
        what the user set (a value equal to the default cannot be told apart, and changes nothing either)."""
        args = self.args
        given = {"per_device_train_batch_size": args.per_device_train_batch_size,
                 "gradient_accumulation_steps": args.gradient_accumulation_steps}
        return {name: value for name, value in given.items() if value != field_default(args, name)}

    def exact_target(self, world: int | None = None) -> int:
        """The effective batch the run is configured for now: target_batch_size, or what the batch settings give
        over ``world`` ranks (default: the arguments' world size). The one place this is derived."""
        return self.target_batch_size or self.given_batch(world)

    def given_batch(self, world: int | None = None) -> int:
        """What the batch settings give per optimizer step: per_device_train_batch_size x gradient_accumulation_steps
        x ``world`` ranks (default: the arguments' world size); ``world=1``: one rank's window."""
        args = self.args
        return (args.per_device_train_batch_size * args.gradient_accumulation_steps
                * (args.world_size if world is None else world))


def field_default(args, name: str):
    """The default of field ``name`` in the arguments' own class (TRL's configs have their own)."""
    return next(f.default for f in dataclasses.fields(type(args)) if f.name == name)
