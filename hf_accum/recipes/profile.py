"""Where each value of a resolved recipe comes from, in the order they apply (a later one wins):

- **recipe**: the recipe file's sections, a real fine-tune of a pretrained model;
- **profile**: the file's `tiny:` section (the offline demonstration's values), applied only when model.name is
  `tiny`, so none of them reaches a run of another model;
- **override**: the user's `key=value` (and what one implies, e.g. save_steps -> save_strategy=steps);
- **machine**: what no one above set and the machine decides: the device (use_cpu), the precision (bf16, and
  bfloat16 weights where the GPU supports it) and the memory budget (0.9 of the device);
- **default**: a model/data field no one set (the section's own default).

Pure dictionaries, except :func:`machine_values`, which asks torch about the device.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from .files import RecipeError, parse_value

PROFILE = "tiny"  # the top-level key of the offline profile, and the model name it applies to
SOURCES = ("recipe", "profile", "override", "machine", "default")


def split(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the recipe without its profile, the profile's sections)."""
    config = dict(config)
    profile = config.pop(PROFILE, None) or {}
    if not isinstance(profile, dict) or not all(isinstance(v, dict) for v in profile.values()):
        raise RecipeError(f"the recipe's {PROFILE}: section must map sections (model, data, lora, training) to keys "
                          f"and values, not {profile!r}; fix the recipe file")
    return config, profile


def model_name(config: dict[str, Any], overrides: Iterable[str]) -> Any:
    """model.name after overrides, read before they are applied (the profile applies under them)."""
    name = (config.get("model") or {}).get("name", "tiny")
    for item in overrides:
        key, _, text = item.partition("=")
        if key.strip() in ("model", "model.name"):
            name = parse_value(text)
    return name


def merge(config: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """``config`` with each section.key of ``layer`` set (a key's value is replaced whole, lists and mappings too)."""
    out = copy.deepcopy(config)
    for section, values in layer.items():
        target = out.get(section)
        out[section] = target = dict(target) if isinstance(target, dict) else {}
        target.update(copy.deepcopy(values))
    return out


def keys_of(config: dict[str, Any]) -> set[str]:
    return {f"{s}.{k}" for s, values in config.items() if isinstance(values, dict) for k in values}


def machine_values(device: str | None = None) -> dict[str, dict[str, Any]]:
    """What the machine decides: ``device`` "cuda"/"cpu" (None: the GPU where torch sees one, else the CPU)."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = str(device).startswith("cuda")
    bf16 = gpu and (not torch.cuda.is_available() or torch.cuda.is_bf16_supported())
    return {"model": {"dtype": "bfloat16" if bf16 else None},
            "training": {"use_cpu": not gpu, "bf16": bf16}}


def fill_machine(config: dict[str, Any], device: str | None = None) -> set[str]:
    """Set, in place, each machine value that nothing set; returns the keys it set. The budget: 0.9 of the device
    (memory_budget) unless memory_budget or memory_budget_bytes was given."""
    values = machine_values(device)
    training = config.setdefault("training", {})
    if "memory_budget" not in training and training.get("memory_budget_bytes") is None:
        values["training"]["memory_budget"] = 0.9
    if (config.get("model") or {}).get("quantization") is not None:
        values["model"].pop("dtype")  # QLoRA names its own dtype for what stays unquantized
    filled = set()
    for section, layer in values.items():
        target = config.setdefault(section, {})
        for key, value in layer.items():
            if key not in target:
                target[key] = value
                filled.add(f"{section}.{key}")
    return filled


def sources(config: dict[str, Any], *, recipe: set[str], profile: set[str], override: set[str],
            machine: set[str]) -> dict[str, str]:
    """section.key -> where its value came from, for every key of ``config``."""
    out = {}
    for key in sorted(keys_of(config)):
        out[key] = ("override" if key in override else "profile" if key in profile else
                    "machine" if key in machine else "recipe" if key in recipe else "default")
    return out


def override_keys(paths: Iterable[tuple[str, ...]]) -> set[str]:
    """The section.key each resolved override path sets (a nested model.quantization.x sets model.quantization)."""
    return {".".join(path[:2]) for path in paths}


# --- a run that still looks like the toy's -----------------------------------------------------------------------
def toy_warning(recipe, args, model) -> str | None:
    """One line where a run of another model than the tiny one keeps settings that only suit the tiny one: a memory
    budget smaller than the model's weights, or a LoRA learning rate of 1e-3 or more on a pretrained base."""
    if recipe.model.name == PROFILE:
        return None
    problems = []
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = args.memory_budget_bytes
    if budget is not None and budget < weights:
        problems.append(f"training.memory_budget_bytes={budget} ({budget / 2**20:.0f} MiB) is smaller than the "
                        f"model's weights ({weights / 2**20:.0f} MiB): set memory_budget_bytes=null (0.9 of the "
                        "device)")
    if args.learning_rate >= 1e-3:
        problems.append(f"training.learning_rate={args.learning_rate:g} is a rate for a random base: LoRA on a "
                        "pretrained one uses about 2e-4 (SFT) or less (DPO, GRPO)")
    if not problems:
        return None
    return f"warning: settings of a toy run on {recipe.model.name}: " + "; ".join(problems)
