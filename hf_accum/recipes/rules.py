"""The checks of a recipe's values that need no model, as tables: what type each key takes (read from the
dataclasses once and cached as JSON, see `config.field_specs`) and, per key, the values it takes (a range or a
choice) with the one line that says the fix.

Nothing here imports torch, transformers, peft or TRL: `hf-accum train lora_sft learning_rate=-1` answers as fast
as a mistyped key. The checks that need the built arguments (the world size, a DeepSpeed config) stay in
`AccumTrainingArguments.__post_init__`, the ones that need the model in `recipes.model`. Every value a training rule
refuses, the arguments refuse too, for a user of the Python API (tests/recipes/test_recipe_checks.py): the table adds speed,
never a rule of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from ..probing.loading import KBIT_PREPARATIONS, missing_path
from .files import RecipeError
from .values import decode, describe, fits, kind

# model.task -> the peft task type of its LoRA. "dpo" trains a causal LM on preference pairs.
TASKS = {"causal_lm": "CAUSAL_LM", "seq_cls": "SEQ_CLS", "dpo": "CAUSAL_LM", "grpo": "CAUSAL_LM"}
# hf_accum.window.loss.NORMALIZATIONS (loss.py imports torch; a test keeps the two equal)
LOSS_NORMALIZATIONS = ("tokens", "samples", "model")
# model.dtype: the floating dtypes weights are loaded in (torch's names), "auto" (the checkpoint's) or null (float32)
WEIGHT_DTYPES = ("float32", "float", "bfloat16", "float16", "half", "float64", "double", "auto")

# Values the run interprets before the dataclass sees them (checkpoint_layers: the field is a string for the
# command-line parser, and the arguments take an integer K as well).
EXTRA_TYPES: dict[tuple[str, str], Any] = {("training", "resume_from_checkpoint"): bool | str | None,
                                           ("training", "checkpoint_layers"): int | str | None}
# List fields whose class takes one item as well (TRL's DPOConfig.__post_init__ wraps a string loss_type in a list;
# pinned by tests/recipes/test_recipe_checks.py): the type check accepts what the class accepts.
ONE_FOR_A_LIST: dict[tuple[str, str], Any] = {("training", "loss_type"): str}


def check_types(config: dict[str, Any], specs: dict[str, dict[str, list]]) -> None:
    """Every value has its field's type (`learning_rate=abc` is an error here, not a TypeError mid-run).
    ``specs``: section -> key -> [encoded annotation, default], as `config.field_specs` caches them."""
    for section, values in config.items():
        known = specs.get(section, {})
        for key, value in (values or {}).items():
            hint = EXTRA_TYPES.get((section, key))
            if hint is None and key in known:
                hint = decode(known[key][0])
                if (section, key) in ONE_FOR_A_LIST:
                    hint = hint | ONE_FOR_A_LIST[section, key]
            if hint is not None and not fits(value, hint):
                default = known[key][1] if key in known else None
                raise RecipeError(
                    f"{section}.{key}={value!r} is {kind(value)}, but {section}.{key} takes {describe(hint)}; "
                    f"set it to such a value (e.g. {key}={_example(hint, default)})"
                )


def _example(hint: Any, default: Any = None) -> str:
    if isinstance(default, bool | str) or (isinstance(default, int | float) and default > 0):
        if fits(default, hint):
            return str(default).lower() if isinstance(default, bool) else str(default)
    for candidate, text in ((0.0001, "1e-4"), (8, "8"), (True, "true"), ("name", "name"), ([], "[a,b]"), ({}, "{}")):
        if fits(candidate, hint):
            return text
    return "null"


# --- the values each key takes ----------------------------------------------------------------------------------
def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def positive(value: Any, _config: dict[str, Any]) -> bool:
    return value is None or (_integer(value) and value > 0)


def whole(value: Any, _config: dict[str, Any]) -> bool:
    return _integer(value) and value >= 0


def one_of(*choices: Any) -> Callable[[Any, dict[str, Any]], bool]:
    return lambda value, _config: value in choices


def _layers(value: Any, _config: dict[str, Any]) -> bool:
    if isinstance(value, str):
        text = value.strip().lower()
        return text in ("auto", "", "none", "null") or text.isdigit()
    return value is None or (_integer(value) and value >= 0)


def _epochs(value: Any, config: dict[str, Any]) -> bool:
    return (config.get("training") or {}).get("max_steps", -1) != -1 or not _number(value) or value > 0


def _held_out_rows(value: Any, config: dict[str, Any]) -> bool:
    return str(value).lower() in ("no", "intervalstrategy.no") or bool((config.get("data") or {}).get("eval_examples"))


class Rule(NamedTuple):
    """``key`` ("section.field"), when given, is refused where ``ok(value, the whole config)`` is False; ``message``
    is formatted with {section}, {key}, {value} (its repr) and {text} (its str, lower case)."""

    key: str
    ok: Callable[[Any, dict[str, Any]], bool]
    message: str


_POSITIVE = "{section}.{key}={value} must be a positive integer"
RULES: tuple[Rule, ...] = (
    Rule("model.task", one_of(*TASKS), "model.task={value} must be one of " + str(list(TASKS))),
    Rule("model.kbit_preparation", one_of(*KBIT_PREPARATIONS),
         "model.kbit_preparation={value} must be one of " + str(list(KBIT_PREPARATIONS))),
    Rule("model.quantization", lambda v, _c: v is None or isinstance(v, dict),
         "model.quantization={value} must be a mapping of BitsAndBytesConfig arguments (e.g. {{load_in_4bit: true, "
         "bnb_4bit_quant_type: nf4}}) or null"),
    Rule("model.dtype", one_of(None, *WEIGHT_DTYPES),
         "model.dtype={value} is not a torch dtype; use float32, bfloat16, float16, auto or null"),
    Rule("model.name", lambda v, _c: missing_path("model.name", v) is None,
         "model.name={value} is a path, but there is no such directory: give the directory a model was saved to "
         "with save_pretrained, or a hub id (org/name)"),  # loading.missing_path's words, before any import
    Rule("model.cpu_threads", positive, _POSITIVE),
    Rule("data.max_length", positive, _POSITIVE),
    Rule("data.num_examples", positive, _POSITIVE),
    Rule("data.eval_examples", whole,
         "data.eval_examples={value} must be a whole number of rows to hold out for evaluation (0: none)"),
    Rule("lora.r", lambda v, _c: not _integer(v) or v >= 1,
         "lora.r={value} must be a positive integer (the adapter's rank, e.g. lora.r=16)"),
    Rule("lora.lora_dropout", lambda v, _c: not _number(v) or 0 <= v < 1,
         "lora.lora_dropout={value} must be a probability in [0, 1) (e.g. lora.lora_dropout=0.05)"),
    *(Rule(f"training.{name}", positive,  # TRL slices [:max_length]: a negative one drops the last tokens instead
           f"training.{{key}}={{value}} must be a positive number of tokens (or null: no limit), e.g. {name}=1024")
      for name in ("max_length", "max_completion_length")),
    Rule("training.learning_rate", lambda v, _c: not _number(v) or math.isfinite(v),
         "training.learning_rate={value} is not a finite number: set a positive learning_rate, e.g. 2e-4"),
    Rule("training.learning_rate", lambda v, _c: not _number(v) or v >= 0,
         "training.learning_rate={value} is negative: set a positive learning_rate, e.g. 2e-4"),
    Rule("training.num_train_epochs", _epochs,
         "training.num_train_epochs={value} with max_steps=-1 trains nothing (0 optimizer steps, an untrained model "
         "saved): set num_train_epochs > 0, or max_steps=N"),
    Rule("training.max_steps", lambda v, _c: not _integer(v) or v > 0 or v == -1,
         "training: max_steps={value} is not a number of steps: set a positive max_steps to stop after that many "
         "optimizer steps, or -1 (the default) to train num_train_epochs epochs."),  # AccumTrainingArguments' words
    *(Rule(f"training.{name}", positive, _POSITIVE) for name in (
        "target_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps", "memory_budget_bytes",
        "probe_seq_len", "probe_max_micro_batch", "max_tokens_per_forward")),
    *(Rule(f"training.{name}", lambda v, _c: not _number(v) or v >= 0,  # AccumTrainingArguments' words
           f"training.{{key}}={{value}} is negative: give a number of optimizer steps (e.g. {name}=500), or a ratio "
           "of the run's steps in (0, 1)") for name in ("save_steps", "eval_steps", "logging_steps")),
    Rule("training.save_total_limit", lambda v, _c: not _number(v) or v >= 0,
         "training.save_total_limit={value} is negative: give how many checkpoints to keep (e.g. save_total_limit=2), "
         "or leave it unset to keep all"),
    Rule("training.memory_budget", lambda v, _c: not _number(v) or 0 < v <= 1,
         "training.memory_budget={value} must be a fraction in (0, 1] of the memory this process can use when "
         "training starts (e.g. 0.9); for an absolute budget set memory_budget_bytes"),
    Rule("training.grow_back_steps", whole,
         "training.grow_back_steps={value} must be an integer >= 0 (0: never grow back)"),
    Rule("training.checkpoint_layers", _layers,
         "training.checkpoint_layers={value} must be 'auto' or an integer >= 0 (the number of decoder layers that "
         "recompute); for every layer or none use gradient_checkpointing=true/false"),
    Rule("training.loss_normalization", one_of(*LOSS_NORMALIZATIONS),
         "training.loss_normalization={value} is not one of " + str(list(LOSS_NORMALIZATIONS)) + ": 'tokens' for "
         "language modelling, 'samples' for one target per sample, 'model' to keep transformers' behaviour"),
    Rule("training.micro_batching", one_of("samples", "tokens"),
         "training.micro_batching={value} must be 'samples' or 'tokens'"),
    Rule("training.auto_tune_optimize", one_of("memory", "throughput"),
         "training.auto_tune_optimize={value} must be 'memory' or 'throughput'"),
    Rule("training.eval_strategy", _held_out_rows, "training.eval_strategy={text} evaluates during training, but no "
         "rows are held out: set data.eval_examples=N (the last N rows become the evaluation set)"),
)


def check_values(config: dict[str, Any]) -> None:
    """The first rule of :data:`RULES` that a value given in ``config`` breaks, as a RecipeError (check the types
    first: the rules assume them)."""
    for rule in RULES:
        section, key = rule.key.split(".")
        values = config.get(section) or {}
        if key in values and not rule.ok(values[key], config):
            raise RecipeError(rule.message.format(section=section, key=key, value=repr(values[key]),
                                                  text=str(values[key]).lower()))
