"""What a "does not fit" message may suggest: only the memory levers that are off. A run that already checkpoints
every layer and trains LoRA must not be told to enable gradient checkpointing and train LoRA."""

from __future__ import annotations

from typing import Any


def levers_on(model) -> dict[str, bool]:
    """Which of the memory levers ``model`` already uses: gradient checkpointing (any layer), LoRA (a PEFT model),
    a 4-bit base. JSON-safe (the probe keeps it in ``ProbeResult.extra["levers_on"]``)."""
    from ..compat.gradient_checkpointing import checkpointed_count

    return {
        "checkpointing": checkpointed_count(model) > 0,
        "lora": isinstance(getattr(model, "peft_config", None), dict),
        "4bit": any(type(m).__name__ == "Linear4bit" for m in model.modules()),
    }


def fit_hints(on: dict[str, Any] | None, *, checkpointing: str = "enable gradient checkpointing",
              rest: tuple[str, ...] = ("shorten the probe sequence length", "raise the memory budget")) -> str:
    """The levers to try, comma-separated: those of :func:`levers_on` that are off (all when ``on`` is unknown),
    then ``rest``."""
    on = on or {}
    hints = [text for key, text in (("checkpointing", checkpointing),
                                    ("lora", "train LoRA adapters instead of all weights"),
                                    ("4bit", "load the base model in 4-bit (QLoRA)")) if not on.get(key)]
    hints += rest
    return ", ".join(hints[:-1]) + ", or " + hints[-1] if len(hints) > 1 else hints[0]
