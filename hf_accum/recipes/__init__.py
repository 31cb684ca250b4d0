"""Recipes: a YAML file with `model` / `data` / `lora` / `training` sections, `key=value` overrides, one run.

    hf-accum train lora_sft                                    # the offline default: tiny model, generated data
    hf-accum train lora_sft model=Qwen/Qwen2.5-0.5B dataset=my_data.jsonl max_steps=500
    hf-accum train recipes/qlora_sft.yaml lora.r=32 training.learning_rate=1e-4

`RECIPE` is a name from the `recipes/` directory (shipped with the package) or the path of a YAML file.

Keys. `section.field=value` sets one field (`model.quantization.bnb_4bit_quant_type=fp4` goes one level into a
mapping); a bare `field=value` works when exactly one section has that field (`max_steps=100`, `r=32`);
`model=...` and `dataset=...` are short for `model.name=...` and `data.dataset=...`. Values are YAML scalars
(`1e-4` is a float, `null` is None, `[q_proj,v_proj]` a list). An unknown key is an error listing the valid ones.

Sections:
- `model`  (:class:`ModelSection`): "tiny" (`tiny.build_model`, offline) or a hub id / local path loaded with
  `AutoModelForCausalLM` / `AutoModelForSequenceClassification`; optional 4-bit quantization (bitsandbytes).
- `data`   (:class:`DataSection`): "tiny" (generated, offline) or a hub id / local JSON, JSONL, CSV or Parquet
  file loaded with `datasets.load_dataset`; chat template used where the tokenizer has one (applied by TRL).
- `lora`   : `peft.LoraConfig` fields; `task_type` follows `model.task` unless given.
- `training`: the fields of the task's trainer config, parsed with `HfArgumentParser.parse_dict` (every field is
  valid): `hf_accum.trl.AccumSFTConfig` (causal_lm: SFT through `AccumSFTTrainer`, TRL's data handling),
  `hf_accum.trl.AccumDPOConfig` (dpo: preference pairs through `AccumDPOTrainer`) or `AccumTrainingArguments`
  (seq_cls).

A run (:func:`run_recipe`) plans micro x accumulation x world = target with the memory probe, prints the plan and
tokens per optimizer step, trains with a progress bar, and writes to `output_dir`: the adapter
(`save_pretrained`), the tokenizer, the resolved recipe (`recipe.yaml`) and `run_summary.json`.
:func:`load_trained` rebuilds the base model from that `recipe.yaml` and loads the adapter onto it.

The code follows that flow, one module per step: :mod:`.config` (YAML + overrides) -> :mod:`.model` ->
:mod:`.data` -> :mod:`.run`; :mod:`.recipe_paper` is a recipe's estimate on paper (`hf-accum probe --estimate
RECIPE`). The YAMLs ship in `yaml/` (in a checkout a link to the repository's `recipes/`). Imports the trainer, the
TRL classes and every wing below them; only the CLI imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

# The config step needs neither torch nor transformers; the rest is imported on first use, so that the CLI can
# read a recipe before deciding what to import (bitsandbytes only when the recipe quantizes).
from .config import (
    ALIASES,
    TASKS,
    Recipe,
    apply_overrides,
    format_recipe,
    load_recipe,
    resolve_key,
    valid_keys,
    write_recipe,
)
from .files import RECIPE_DIRS, SECTIONS, RecipeError, available_recipes, parse_value, read_yaml, recipe_path
from .sections import DataSection, ModelSection

_LAZY = {
    "checkpointing_enabled": "hf_accum.levers.checkpointing",
    **dict.fromkeys(["RecipeData", "build_data", "preference_stats", "sft_stats"], "hf_accum.recipes.data"),
    **dict.fromkeys(["add_lora", "build_model", "build_tokenizer", "configure_checkpointing_for_lora"],
                    "hf_accum.recipes.model"),
    **dict.fromkeys(["RECIPE_FILE", "SUMMARY_FILE", "Built", "RecipeProbe", "RecipeRun", "build", "load_trained",
                     "probe_recipe", "run_recipe"], "hf_accum.recipes.run"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ALIASES",
    "RECIPE_DIRS",
    "RECIPE_FILE",
    "SECTIONS",
    "SUMMARY_FILE",
    "TASKS",
    "DataSection",
    "ModelSection",
    "Recipe",
    "RecipeData",
    "Built",
    "RecipeError",
    "RecipeProbe",
    "RecipeRun",
    "add_lora",
    "apply_overrides",
    "available_recipes",
    "build",
    "build_data",
    "build_model",
    "build_tokenizer",
    "checkpointing_enabled",
    "configure_checkpointing_for_lora",
    "format_recipe",
    "load_recipe",
    "load_trained",
    "parse_value",
    "preference_stats",
    "probe_recipe",
    "read_yaml",
    "recipe_path",
    "resolve_key",
    "run_recipe",
    "sft_stats",
    "valid_keys",
    "write_recipe",
]
