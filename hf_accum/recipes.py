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
  file loaded with `datasets.load_dataset`; chat template used where the tokenizer has one.
- `lora`   : `peft.LoraConfig` fields; `task_type` follows `model.task` unless given.
- `training`: `AccumTrainingArguments` fields, parsed with `HfArgumentParser.parse_dict` (every field is valid).

A run (:func:`run_recipe`) plans micro x accumulation x world = target with the memory probe, prints the plan and
tokens per optimizer step, trains with a progress bar, and writes to `output_dir`: the adapter
(`save_pretrained`), the tokenizer, the resolved recipe (`recipe.yaml`) and `run_summary.json`.
:func:`load_trained` rebuilds the base model from that `recipe.yaml` and loads the adapter onto it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._compat import checkpointing_enabled
from .loading import load_model, not_loadable, require_bitsandbytes
from .loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

SECTIONS = ("model", "data", "lora", "training")
ALIASES = {"model": "model.name", "dataset": "data.dataset"}
TASKS = {"causal_lm": "CAUSAL_LM", "seq_cls": "SEQ_CLS"}
KBIT_PREPARATIONS = ("light", "peft")
SUMMARY_FILE = "run_summary.json"
RECIPE_FILE = "recipe.yaml"
_PACKAGE_DIR = Path(__file__).resolve().parent
# Packaged copy first (a wheel ships recipes/ as hf_accum/recipes_data), then the repository's own directory.
RECIPE_DIRS = (_PACKAGE_DIR / "recipes_data", _PACKAGE_DIR.parent / "recipes")


class RecipeError(ValueError):
    """A recipe or an override that cannot be used; the message names the key and what to set instead."""


# --- sections ------------------------------------------------------------------------------------------------
@dataclass
class ModelSection:
    name: str = "tiny"
    """"tiny" (a small Llama built from config, offline), a hub id, or a local directory."""
    task: str = "causal_lm"
    """"causal_lm" (AutoModelForCausalLM) or "seq_cls" (AutoModelForSequenceClassification)."""
    dtype: str | None = None
    """dtype of the weights that are not quantized: float32 (None), bfloat16, float16, or "auto" (the checkpoint's)."""
    num_labels: int | None = None
    """seq_cls: number of classes; None: from the data."""
    quantization: dict[str, Any] | None = None
    """`transformers.BitsAndBytesConfig` keyword arguments (QLoRA: load_in_4bit, bnb_4bit_quant_type nf4, ...)."""
    kbit_preparation: str = "light"
    """Quantized bases only. "light": freeze, input grads, non-reentrant checkpointing, no upcast (the default);
    "peft": `peft.prepare_model_for_kbit_training`, which also upcasts every non-quantized weight to float32."""
    revision: str | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    tiny: dict[str, Any] = field(default_factory=dict)
    """name=tiny: keyword arguments of `hf_accum.tiny.build_model` (hidden_size, num_layers, num_heads, seed)."""
    cpu_threads: int | None = None
    """On CPU: torch.set_num_threads for the run (restored after); None: torch's default (one per core). A tiny
    model's matmuls are too small to split: 1 thread is fastest, and on shared cores 2 were 10-100x slower."""


@dataclass
class DataSection:
    dataset: str = "tiny"
    """"tiny" (generated tasks, offline), a hub id, a dataset directory, or a local .json/.jsonl/.csv/.parquet file."""
    subset: str | None = None
    """Hub dataset configuration name."""
    split: str = "train"
    num_examples: int | None = None
    """tiny: how many examples to generate (default 2000); otherwise: use the first N rows (None: all)."""
    max_length: int = 512
    """Tokens per example after truncation (the end is cut)."""
    seed: int = 0
    """Seed of the generated tiny data."""
    prompt_field: str = "prompt"
    response_field: str = "response"
    messages_field: str = "messages"
    """SFT rows are {prompt_field, response_field} pairs, or chat `messages` whose last turn (assistant) is the target."""
    text_field: str = "text"
    label_field: str = "label"
    """seq_cls rows are {text_field, label_field}; string labels are mapped to ids in sorted order."""


_SECTION_CLASSES = {"model": ModelSection, "data": DataSection}
_NESTED_KEYS: dict[tuple[str, str], Callable[[], set[str]]] = {}  # filled below, for 3-level keys


def _init_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _lora_keys() -> list[str]:
    from peft import LoraConfig

    return [k for k in _init_fields(LoraConfig) if k not in ("peft_type", "auto_mapping")]


def _training_keys() -> list[str]:
    from .args import AccumTrainingArguments

    return _init_fields(AccumTrainingArguments)


def valid_keys() -> dict[str, list[str]]:
    """The keys each section accepts."""
    return {
        "model": _init_fields(ModelSection),
        "data": _init_fields(DataSection),
        "lora": _lora_keys(),
        "training": _training_keys(),
    }


def _bnb_keys() -> set[str]:
    import inspect

    from transformers import BitsAndBytesConfig

    return {p for p in inspect.signature(BitsAndBytesConfig.__init__).parameters if p not in ("self", "kwargs")}


def _tiny_keys() -> set[str]:
    import inspect

    from . import tiny

    return {p for p in inspect.signature(tiny.build_model).parameters if p not in ("kind", "tokenizer", "dtype")}


_NESTED_KEYS.update({("model", "quantization"): _bnb_keys, ("model", "tiny"): _tiny_keys})


# --- YAML ---------------------------------------------------------------------------------------------------
def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """PyYAML follows YAML 1.1, where `1e-4` is a string; recipes mean the float, as YAML 1.2 does."""

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    return Loader


def parse_value(text: str) -> Any:
    """An override's value as a YAML scalar (or flow list/mapping): "1e-4" -> 1e-4, "null" -> None."""
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError:
        return text


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        data = yaml.load(f, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping with sections {list(SECTIONS)}, not {type(data).__name__}")
    return data


# --- finding a recipe ---------------------------------------------------------------------------------------
def available_recipes() -> list[str]:
    names: set[str] = set()
    for d in RECIPE_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def recipe_path(recipe: str | os.PathLike) -> Path:
    """The YAML file of a recipe name (from the shipped recipes) or a path."""
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise RecipeError(f"recipe file {str(p)!r} does not exist; known recipes: {', '.join(available_recipes())}")
        return p
    for d in RECIPE_DIRS:
        candidate = d / f"{recipe}.yaml"
        if candidate.is_file():
            return candidate
    raise RecipeError(
        f"unknown recipe {str(recipe)!r}: give one of {', '.join(available_recipes()) or '(none found)'} "
        f"or the path of a YAML file (searched {', '.join(str(d) for d in RECIPE_DIRS)})"
    )


# --- overrides ------------------------------------------------------------------------------------------------
def _unknown_key(key: str, keys: dict[str, list[str]], extra: str = "") -> RecipeError:
    dotted = [f"{s}.{k}" for s, ks in keys.items() for k in ks] + list(ALIASES)
    close = difflib.get_close_matches(key, dotted + [k for ks in keys.values() for k in ks], n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    listing = "\n".join(f"  {s}: {', '.join(ks)}" for s, ks in keys.items())
    aliases = ", ".join(f"{a} = {t}" for a, t in ALIASES.items())
    return RecipeError(
        f"unknown key {key!r}.{extra}{hint}\nValid keys (section.key; a bare key works when one section has it; "
        f"aliases: {aliases}):\n{listing}"
    )


def resolve_key(key: str, keys: dict[str, list[str]] | None = None) -> tuple[str, ...]:
    """`"lr"`-style bare keys, aliases and dotted keys -> a (section, field[, subfield]) path; unknown -> error."""
    keys = keys or valid_keys()
    key = ALIASES.get(key, key)
    parts = tuple(key.split("."))
    if len(parts) == 1:
        owners = [s for s, ks in keys.items() if parts[0] in ks]
        if len(owners) == 1:
            return (owners[0], parts[0])
        if len(owners) > 1:
            raise RecipeError(
                f"key {key!r} is in sections {owners}; write it with its section: "
                + " or ".join(f"{s}.{key}" for s in owners)
            )
        raise _unknown_key(key, keys)
    section, name, *rest = parts
    if section not in keys:
        raise _unknown_key(key, keys, f" {section!r} is not a section ({', '.join(SECTIONS)}).")
    if name not in keys[section]:
        raise _unknown_key(key, keys)
    if len(rest) > 1:
        raise _unknown_key(key, keys, " Keys go at most one level into a mapping (section.field.key).")
    if rest:
        allowed = _NESTED_KEYS.get((section, name))
        if allowed is not None and rest[0] not in allowed():
            raise RecipeError(f"unknown key {key!r}: {section}.{name} accepts {', '.join(sorted(allowed()))}")
    return parts


def apply_overrides(config: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of ``config`` with each "key=value" applied (see the module docstring)."""
    import copy

    config = copy.deepcopy(config)
    keys = valid_keys()
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r} is not key=value (e.g. max_steps=100, lora.r=32, model=gpt2)")
        key, text = item.split("=", 1)
        path = resolve_key(key.strip(), keys)
        section = config.setdefault(path[0], {})
        if len(path) == 2:
            section[path[1]] = parse_value(text)
        else:
            mapping = section.get(path[1])
            if mapping is None:
                mapping = section[path[1]] = {}
            if not isinstance(mapping, dict):
                raise RecipeError(f"{path[0]}.{path[1]} is {mapping!r}, not a mapping, so {key!r} cannot be set")
            mapping[path[2]] = parse_value(text)
    return config


# --- the loaded recipe --------------------------------------------------------------------------------------
@dataclass
class Recipe:
    name: str
    path: str | None
    model: ModelSection
    data: DataSection
    lora: dict[str, Any]
    training: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            "lora": dict(self.lora),
            "training": dict(self.training),
        }

    def training_args(self):
        """`AccumTrainingArguments` from the training section (HfArgumentParser, no extra keys allowed)."""
        from transformers import HfArgumentParser

        from .args import AccumTrainingArguments

        with _quiet_deprecations():
            (args,) = HfArgumentParser(AccumTrainingArguments).parse_dict(self.training, allow_extra_keys=False)
        return args

    def lora_config(self):
        from peft import LoraConfig

        kwargs = dict(self.lora)
        kwargs.setdefault("task_type", TASKS[self.model.task])
        return LoraConfig(**kwargs)

    def validate(self):
        """Build everything that needs no model: LoRA config, training arguments. Returns the arguments."""
        self.lora_config()
        return self.training_args()


def load_recipe(recipe: str | os.PathLike | dict[str, Any], overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe (name, path or mapping), apply overrides, check every key and value that needs no model."""
    if isinstance(recipe, dict):
        name, path, config = "custom", None, recipe
    else:
        p = recipe_path(recipe)
        name, path, config = p.stem, str(p), read_yaml(p)
    config = apply_overrides(config, overrides)
    keys = valid_keys()
    for section, values in config.items():
        if section not in SECTIONS:
            raise _unknown_key(section, keys, f" {section!r} is not a section ({', '.join(SECTIONS)}).")
        if values is None:
            config[section] = values = {}
        if not isinstance(values, dict):
            raise RecipeError(f"section {section!r} must be a mapping of keys to values, not {values!r}")
        for key, value in values.items():
            path_ = resolve_key(f"{section}.{key}", keys)
            if isinstance(value, dict) and (section, key) in _NESTED_KEYS:
                for sub in value:
                    resolve_key(f"{'.'.join(path_)}.{sub}", keys)
    model = ModelSection(**config.get("model", {}))
    data = DataSection(**config.get("data", {}))
    out = Recipe(name, path, model, data, dict(config.get("lora", {})), dict(config.get("training", {})))
    _check_sections(out)
    return out


def _check_sections(recipe: Recipe) -> None:
    m, d = recipe.model, recipe.data
    if m.task not in TASKS:
        raise RecipeError(f"model.task={m.task!r} must be one of {list(TASKS)}")
    if m.kbit_preparation not in KBIT_PREPARATIONS:
        raise RecipeError(f"model.kbit_preparation={m.kbit_preparation!r} must be one of {list(KBIT_PREPARATIONS)}")
    if m.quantization is not None and not isinstance(m.quantization, dict):
        raise RecipeError(
            f"model.quantization={m.quantization!r} must be a mapping of BitsAndBytesConfig arguments "
            "(e.g. {load_in_4bit: true, bnb_4bit_quant_type: nf4}) or null"
        )
    for section, name, value in (("data", "max_length", d.max_length), ("data", "num_examples", d.num_examples),
                                 ("model", "cpu_threads", m.cpu_threads)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise RecipeError(f"{section}.{name}={value!r} must be a positive integer")
    if "output_dir" not in recipe.training:
        raise RecipeError("training.output_dir is not set: add output_dir to the recipe or pass output_dir=DIR")


@contextlib.contextmanager
def _quiet_deprecations():
    # transformers 5.23 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs); recipes keep
    # the old names, the only ones transformers 5.17 (the oldest supported) knows, so the rename warning is noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning)
        yield


# --- tokenizer, data -------------------------------------------------------------------------------------------
def build_tokenizer(recipe: Recipe):
    m = recipe.model
    if m.name == "tiny":
        from . import tiny

        return tiny.build_tokenizer()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(m.name, revision=m.revision, trust_remote_code=m.trust_remote_code)
    except OSError as exc:
        raise RecipeError(str(not_loadable("model.name", m.name, exc))) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise RecipeError(f"tokenizer of {m.name!r} has neither a pad nor an eos token; add a pad token to it")
        tok.pad_token = tok.eos_token  # padding is masked out of attention and labels, so any id works
    tok.padding_side = "right"
    return tok


@dataclass
class RecipeData:
    dataset: Any
    collator: Any
    num_labels: int | None
    mean_tokens: float
    mean_targets: float
    longest: int


def build_data(recipe: Recipe, tokenizer) -> RecipeData:
    """Tokenized training examples (a list-backed torch Dataset), the collator and per-example token statistics."""
    from . import tiny

    d, task = recipe.data, recipe.model.task
    num_labels = recipe.model.num_labels
    if d.dataset == "tiny":
        n = d.num_examples or 2000
        if task == "causal_lm":
            dataset = tiny.build_sft_dataset(n, tokenizer, max_length=d.max_length, seed=d.seed)
        else:
            dataset = tiny.build_classification_dataset(n, tokenizer, max_length=d.max_length, seed=d.seed)
            num_labels = num_labels or 2
    else:
        rows = _load_rows(d)
        if task == "causal_lm":
            tokenized = [_tokenize_sft_row(r, tokenizer, d) for r in rows]
            dataset = tiny.ListDataset([r for r in tokenized if _target_count(r["labels"]) > 0])
        else:
            rows, num_labels = _classification_rows(rows, d, num_labels)
            dataset = tiny.ListDataset([tiny.tokenize_classification(r, tokenizer, d.max_length) for r in rows])
    if len(dataset) == 0:
        raise RecipeError(f"data.dataset={d.dataset!r} gave no training example with a target token after tokenization")
    if task == "causal_lm":
        collator, targets = tiny.SFTCollator(tokenizer), [_target_count(r["labels"]) for r in dataset.rows]
    else:
        collator, targets = tiny.ClassificationCollator(tokenizer), [1] * len(dataset)
    lengths = [len(r["input_ids"]) for r in dataset.rows]
    return RecipeData(
        dataset, collator, num_labels, sum(lengths) / len(lengths), sum(targets) / len(targets), max(lengths)
    )


def _target_count(labels) -> int:
    return sum(x != -100 for x in labels[1:])  # causal shift: position 0 is never predicted


def _load_rows(d: DataSection):
    from datasets import load_dataset

    builders = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    path = Path(d.dataset)
    if path.suffix.lower() in builders:
        if not path.is_file():
            raise RecipeError(f"data.dataset={d.dataset!r}: no such file")
        ds = load_dataset(builders[path.suffix.lower()], data_files=str(path), split="train")
    else:
        ds = load_dataset(d.dataset, d.subset, split=d.split)
    if d.num_examples is not None:
        ds = ds.select(range(min(d.num_examples, len(ds))))
    return ds


def _tokenize_sft_row(row: dict[str, Any], tokenizer, d: DataSection) -> dict[str, list[int]]:
    from . import tiny

    if d.messages_field in row and row[d.messages_field]:
        return tokenize_messages(row[d.messages_field], tokenizer, d.max_length)
    if d.prompt_field in row and d.response_field in row:
        pair = {"prompt": str(row[d.prompt_field]), "response": str(row[d.response_field])}
        return tiny.tokenize_sft(pair, tokenizer, d.max_length)
    raise RecipeError(
        f"data.dataset={d.dataset!r} has columns {sorted(row)}; an SFT row needs data.prompt_field and "
        f"data.response_field (now {d.prompt_field!r}, {d.response_field!r}) or chat messages in data.messages_field "
        f"(now {d.messages_field!r}). Set them to your column names, e.g. prompt_field=instruction response_field=output"
    )


def tokenize_messages(messages: list[dict[str, str]], tokenizer, max_length: int | None) -> dict[str, list[int]]:
    """A chat rendered with the tokenizer's template; the last (assistant) turn is the target, the rest is -100."""
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError("rows with chat messages need a tokenizer with a chat template; use prompt/response columns")
    if messages[-1].get("role") != "assistant":
        raise RecipeError(f"the last chat message must be the assistant's (the target), got {messages[-1].get('role')!r}")
    from .tiny import chat_prompt_and_target

    try:
        prompt_ids, target_ids = chat_prompt_and_target(messages, tokenizer)
    except ValueError as exc:
        raise RecipeError(f"{exc} (data.prompt_field / data.response_field)") from None
    ids = (prompt_ids + target_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + target_ids)[:max_length]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def _classification_rows(rows, d: DataSection, num_labels: int | None):
    missing = [f for f in (d.text_field, d.label_field) if f not in rows.column_names]
    if missing:
        raise RecipeError(
            f"data.dataset={d.dataset!r} has columns {rows.column_names}; set data.text_field and data.label_field "
            f"(now {d.text_field!r}, {d.label_field!r}) to the text and label columns"
        )
    labels = rows[d.label_field]
    names = getattr(rows.features[d.label_field], "names", None)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in labels):
        ids = labels
        num_labels = num_labels or (len(names) if names else max(ids) + 1)
    else:
        vocab = {v: i for i, v in enumerate(sorted({str(x) for x in labels}))}
        ids = [vocab[str(x)] for x in labels]
        num_labels = num_labels or len(vocab)
    return [{"text": t, "label": y} for t, y in zip(rows[d.text_field], ids)], num_labels


# --- model ------------------------------------------------------------------------------------------------------
def _torch_dtype(name: str | None):
    import torch

    if name in (None, "auto"):
        return name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise RecipeError(f"model.dtype={name!r} is not a torch dtype; use float32, bfloat16, float16 or auto")
    return dtype


def build_model(recipe: Recipe, tokenizer, *, num_labels: int | None = None, use_cpu: bool = False):
    """The base model (quantized when `model.quantization` is set), not yet wrapped by peft."""
    import torch

    m = recipe.model
    try:
        if m.quantization is not None:
            require_bitsandbytes("model.quantization", "train LoRA on the unquantized base: `hf-accum train "
                                 "lora_sft`, or set model.quantization=null")
        return load_model(
            m.name, task=m.task, dtype=_torch_dtype(m.dtype), quantization=m.quantization,
            device="cpu" if use_cpu and m.quantization is not None or not torch.cuda.is_available() else None,
            num_labels=num_labels or m.num_labels or 2, tokenizer=tokenizer, tiny=m.tiny, label="model.name",
            revision=m.revision, trust_remote_code=m.trust_remote_code or None,
            attn_implementation=m.attn_implementation,
        )
    except RecipeError:
        raise
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def configure_checkpointing_for_lora(args) -> bool:
    """With checkpointing on, make it the LoRA-safe kind: non-reentrant unless the recipe says otherwise.

    Reentrant checkpointing computes no parameter gradient inside a segment whose inputs do not require grad,
    and with a frozen base they do not, so the adapters would silently not train; non-reentrant has no such
    condition. `enable_input_require_grads()` (done by :func:`add_lora`) covers a recipe that insists on reentrant.
    """
    if not checkpointing_enabled(args):
        return False
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
    if "use_reentrant" not in kwargs:
        kwargs["use_reentrant"] = False
        logger.info("hf_accum: gradient checkpointing with LoRA: use_reentrant=False")
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        if hasattr(args, name):
            setattr(args, name, kwargs)  # 5.23 mirrors the old name onto the new; keep both pointing at one dict
    return True


def add_lora(model, recipe: Recipe, args):
    """k-bit preparation (quantized bases), input grads for checkpointing, then `get_peft_model`."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    checkpointing = configure_checkpointing_for_lora(args)
    with _quiet_deprecations():
        if recipe.model.quantization is not None and recipe.model.kbit_preparation == "peft":
            kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs=kwargs
            )
        if checkpointing:
            # The embeddings' output requires grad, so any checkpointed segment has an input that needs a gradient.
            model.enable_input_require_grads()
        return get_peft_model(model, recipe.lora_config())


# --- the run ------------------------------------------------------------------------------------------------------
@dataclass
class RecipeRun:
    recipe: Recipe
    trainer: Any
    model: Any
    tokenizer: Any
    summary: dict[str, Any]
    output_dir: str


def run_recipe(
    recipe: str | os.PathLike | dict[str, Any] | Recipe,
    overrides: Sequence[str] = (),
    *,
    say: Callable[[str], None] | None = None,
    callbacks: Sequence[Any] = (),
) -> RecipeRun:
    """Load, build, plan, train, save. ``say`` prints the plan and results (default: print on the main process)."""
    start = time.perf_counter()
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    elif overrides:
        raise RecipeError("overrides go with a recipe name or path, not with an already loaded Recipe")
    args = recipe.validate()
    main_process = args.process_index == 0
    say = say or (print if main_process else (lambda _msg: None))
    with _cpu_threads(recipe.model.cpu_threads, args):
        return _run(recipe, args, say, callbacks, start, main_process)


@contextlib.contextmanager
def _cpu_threads(n: int | None, args):
    import torch

    if n is None or not (args.use_cpu or not torch.cuda.is_available()):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(recipe: Recipe, args, say, callbacks, start: float, main_process: bool) -> RecipeRun:
    say(f"recipe {recipe.name}" + (f" ({recipe.path})" if recipe.path else ""))

    from transformers import set_seed

    # Seeded before the model is built: the LoRA matrices (and a new head) are initialized from the global RNG,
    # which the Trainer only seeds later, in its __init__. Without this two runs of a recipe differ.
    set_seed(args.seed)
    tokenizer = build_tokenizer(recipe)
    data = build_data(recipe, tokenizer)
    model = build_model(recipe, tokenizer, num_labels=data.num_labels, use_cpu=args.use_cpu)
    model = add_lora(model, recipe, args)
    trainable, total = _count_parameters(model)
    say(
        f"model {recipe.model.name} ({type(model.get_base_model()).__name__}"
        + _quantization_text(recipe.model.quantization)
        + f"), LoRA r={model.peft_config['default'].r}: {trainable:,} trainable of {total:,} parameters"
    )
    unit = "target tokens" if recipe.model.task == "causal_lm" else "labels"
    say(
        f"data {recipe.data.dataset}: {len(data.dataset)} examples, {data.mean_tokens:.1f} tokens and "
        f"{data.mean_targets:.1f} {unit} per example on average, longest {data.longest}"
    )

    from .trainer import AccumTrainer

    trainer = AccumTrainer(
        model=model, args=args, train_dataset=data.dataset, data_collator=data.collator,
        processing_class=tokenizer, callbacks=list(callbacks),
    )
    plan = None
    if args.tunes:
        say(f"probing memory: real training steps against a budget of {_budget_text(args)} ...")
        plan = trainer.tune()
        trainer.args.auto_tune = False  # planned once, here; train() must not probe again (nor forget probe_result)
    plan_dict = plan.to_dict() if plan is not None else {
        "micro_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "world_size": args.world_size,
        "target_batch_size": args.effective_batch_size,
    }
    per_step = plan_dict["target_batch_size"]
    probe = _probe_summary(trainer, plan_dict["micro_batch_size"])
    say(
        f"plan: micro {plan_dict['micro_batch_size']} x accumulation {plan_dict['gradient_accumulation_steps']} x "
        f"world {plan_dict['world_size']} = {per_step} samples per optimizer step"
        + (" (reused the stored plan)" if plan is not None and trainer.probe_result is None else "")
    )
    say(
        f"tokens per optimizer step: {per_step} x {data.mean_tokens:.1f} = ~{per_step * data.mean_tokens:,.0f} "
        f"(~{per_step * data.mean_targets:,.0f} {unit}, over which the loss is averaged: "
        f"loss_normalization={args.loss_normalization})"
    )
    if probe.get("peak_bytes") is not None:
        say(f"peak memory per step at micro {plan_dict['micro_batch_size']}: {_mib(probe['peak_bytes'])} "
            f"({probe['peak_source']}; budget {_mib(probe['budget_bytes'])})")

    if main_process and args.should_save:
        os.makedirs(args.output_dir, exist_ok=True)  # before training: a crash still leaves what was run
        write_recipe(recipe, os.path.join(args.output_dir, RECIPE_FILE))
    cuda_peak = _reset_cuda_peak(model)
    with _quiet_deprecations():
        result = trainer.train()
    train_seconds = result.metrics.get("train_runtime")
    if trainer.plan is not None and trainer.plan.to_dict() != plan_dict:  # out of memory mid-run: a smaller micro
        say(f"the plan was lowered during training (out of memory): {trainer.plan.describe()}")
        plan_dict = trainer.plan.to_dict()
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h and "step" in h]
    tokens = getattr(trainer.state, "num_input_tokens_seen", 0) or None
    if tokens is None:  # include_num_input_tokens_seen is off: estimate from the data
        tokens = round(trainer.state.global_step * per_step * data.mean_tokens)
    trainer.save_model(args.output_dir)  # adapter (adapter_config.json + weights, modules_to_save too) + tokenizer

    summary = {
        "recipe": recipe.name,
        "recipe_path": recipe.path,
        "plan": plan_dict,
        "plan_description": (
            f"micro {plan_dict['micro_batch_size']} x accumulation {plan_dict['gradient_accumulation_steps']} x "
            f"world {plan_dict['world_size']} = {per_step}"
        ),
        "tokens_per_optimizer_step": per_step * data.mean_tokens,
        "targets_per_optimizer_step": per_step * data.mean_targets,
        "loss_normalization": args.loss_normalization,
        "peak_memory_bytes": probe.get("peak_bytes"),
        "probe": probe,
        "training_peak_memory_bytes": cuda_peak() if cuda_peak else None,
        "trainable_parameters": trainable,
        "total_parameters": total,
        "examples": len(data.dataset),
        "steps": trainer.state.global_step,
        "tokens_seen": tokens,
        "train_seconds": train_seconds,
        "tokens_per_second": tokens / train_seconds if train_seconds else None,
        "train_loss": result.metrics.get("train_loss"),  # mean over all steps
        "first_loss": losses[0][1] if losses else None,
        "last_loss": losses[-1][1] if losses else None,
        "losses": [{"step": s, "loss": v} for s, v in losses],
        "wall_seconds": time.perf_counter() - start,
        "output_dir": os.path.abspath(args.output_dir),
        "config": recipe.to_dict(),
        "versions": _versions(),
    }
    if main_process and args.should_save:
        with open(os.path.join(args.output_dir, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    if losses:
        say(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} (first and last logged, every "
            f"{args.logging_steps} steps); {summary['steps']} steps in {train_seconds:.1f} s, "
            f"{summary['tokens_per_second']:,.0f} tokens/s")
    say(f"saved the adapter and tokenizer to {args.output_dir}; summary: {os.path.join(args.output_dir, SUMMARY_FILE)} "
        f"(wall time {summary['wall_seconds']:.1f} s)")
    return RecipeRun(recipe, trainer, model, tokenizer, summary, args.output_dir)


def format_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (every key, overrides applied): what `recipe.yaml` in output_dir holds."""
    import yaml

    header = f"# resolved recipe {recipe.name!r}" + (f" from {recipe.path}" if recipe.path else "") + "\n"
    return header + yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def write_recipe(recipe: Recipe, path: str) -> None:
    with open(path, "w") as f:
        f.write(format_recipe(recipe))


def load_trained(output_dir: str, *, use_cpu: bool = True):
    """(model, tokenizer): the base rebuilt from `output_dir/recipe.yaml`, the saved adapter loaded onto it."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    recipe = load_recipe(os.path.join(output_dir, RECIPE_FILE))
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    num_labels = recipe.model.num_labels
    if recipe.model.task == "seq_cls" and num_labels is None:
        num_labels = build_data(recipe, tokenizer).num_labels
    base = build_model(recipe, tokenizer, num_labels=num_labels, use_cpu=use_cpu)
    return PeftModel.from_pretrained(base, output_dir), tokenizer


# --- summary helpers ----------------------------------------------------------------------------------------------
def _count_parameters(model) -> tuple[int, int]:
    trainable = total = 0
    for p in model.parameters():
        # A 4-bit weight is stored packed, two values per byte: count the values it holds.
        n = p.numel() * 2 if p.__class__.__name__ == "Params4bit" else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def _probe_summary(trainer, micro: int) -> dict[str, Any]:
    """What the probe measured (this run, or the run whose stored plan was reused), and the peak at ``micro``."""
    from .plan_store import PLAN_FILE

    if trainer.probe_result is not None:
        probe, reused = trainer.probe_result.to_dict(), False
    else:
        try:
            with open(os.path.join(trainer.args.output_dir, PLAN_FILE)) as f:
                probe, reused = json.load(f).get("probe") or {}, True
        except (OSError, ValueError):
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


def _reset_cuda_peak(model) -> Callable[[], int] | None:
    import torch

    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return lambda: int(torch.cuda.max_memory_allocated(device))


def _quantization_text(quantization: dict[str, Any] | None) -> str:
    if not quantization:
        return ""
    if quantization.get("load_in_4bit"):
        return f", 4-bit {quantization.get('bnb_4bit_quant_type', 'fp4')}"
    return ", 8-bit" if quantization.get("load_in_8bit") else ""


def _budget_text(args) -> str:
    if args.memory_budget_bytes is not None:
        return _mib(args.memory_budget_bytes)
    return f"{args.memory_budget:.0%} of the device's memory"


def _mib(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _versions() -> dict[str, str | None]:
    from .plan_store import _version

    return {name: _version(name) for name in ("hf-accum", "torch", "transformers", "peft", "bitsandbytes", "trl")}


__all__ = [
    "DataSection",
    "ModelSection",
    "Recipe",
    "RecipeError",
    "RecipeRun",
    "apply_overrides",
    "available_recipes",
    "load_recipe",
    "load_trained",
    "parse_value",
    "recipe_path",
    "run_recipe",
    "valid_keys",
]

