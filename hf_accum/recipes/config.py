"""Step 1 of a recipe: the config. A YAML file (or mapping) with `model` / `data` / `lora` / `training`
sections, `key=value` overrides applied, every key and value that needs no model checked (:func:`load_recipe`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import profile, rules
from .files import SECTIONS, RecipeError, parse_value, read_yaml, recipe_path
from .rules import TASKS
from .sections import DataSection, ModelSection

ALIASES = {"model": "model.name", "dataset": "data.dataset"}
# model.task -> the class of its `training` section (module, name): the trainer's own config, so every key TRL
# accepts is a recipe key. Imported on first use (TRL is slow to import; classification does not need it).
TRAINING_CLASSES = {
    "causal_lm": ("hf_accum.trl", "AccumSFTConfig"),
    "seq_cls": ("hf_accum.args", "AccumTrainingArguments"),
    "dpo": ("hf_accum.trl", "AccumDPOConfig"),
    "grpo": ("hf_accum.trl", "AccumGRPOConfig"),
}



_SECTION_CLASSES = {"model": ModelSection, "data": DataSection}
_NESTED_KEYS: dict[tuple[str, str], Callable[[], set[str]]] = {}  # filled below, for 3-level keys


def _init_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _lora_keys() -> list[str]:
    from peft import LoraConfig

    return [k for k in _init_fields(LoraConfig) if k not in ("peft_type", "auto_mapping")]


def training_class(task: str = "causal_lm") -> type:
    """The dataclass of the `training` section for ``task`` (AccumTrainingArguments, or TRL's config + hf_accum's)."""
    import importlib

    module, name = TRAINING_CLASSES.get(task, TRAINING_CLASSES["causal_lm"])
    return getattr(importlib.import_module(module), name)


def valid_keys(task: str = "causal_lm") -> dict[str, list[str]]:
    """The keys each section accepts (the training keys depend on model.task)."""
    return _cached(f"keys:{task}", lambda: {
        "model": _init_fields(ModelSection),
        "data": _init_fields(DataSection),
        "lora": _lora_keys(),
        "training": _init_fields(training_class(task)),
    })


# --- the key lists, cached: reading them imports peft, TRL and transformers (seconds), so a mistyped key would take
# that long to report. They are stored per installed version of those libraries and of hf_accum's own field
# definitions; the first run after an install or upgrade reads them from the classes.
_KEY_SOURCES = ("args.py", "trl.py", "tiny.py", "recipes/config.py", "recipes/sections.py", "recipes/values.py")


def _keys_cache_file() -> Path | None:
    import hashlib
    from importlib import metadata

    parts = []
    for dist in ("transformers", "trl", "peft", "torch"):
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=none")
    package = Path(__file__).resolve().parent.parent
    try:
        parts += [hashlib.sha256((package / name).read_bytes()).hexdigest() for name in _KEY_SOURCES]
    except OSError:
        return None
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "hf_accum" / f"recipe-keys-{digest}.json"


def _cached(name: str, compute: Callable[[], Any]) -> Any:
    import json

    path = _keys_cache_file()
    stored: dict[str, Any] = {}
    if path is not None:
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
        if name in stored:
            return stored[name]
    value = compute()
    if path is not None:
        try:  # best effort: a read-only home only costs the imports next time
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**stored, name: value}, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass
    return value


def task_of(config: dict[str, Any], overrides: Iterable[str] = ()) -> str:
    """model.task after overrides, read before the keys are checked (the training keys depend on it)."""
    task = (config.get("model") or {}).get("task", "causal_lm")
    for item in overrides:
        key, _, text = item.partition("=")
        if key.strip() in ("task", "model.task"):
            task = parse_value(text)
    return task if task in TASKS else "causal_lm"


def _bnb_keys() -> set[str]:
    def read() -> list[str]:
        import inspect

        from transformers import BitsAndBytesConfig

        return sorted(p for p in inspect.signature(BitsAndBytesConfig.__init__).parameters if p not in ("self", "kwargs"))

    return set(_cached("nested:model.quantization", read))


def _tiny_keys() -> set[str]:
    def read() -> list[str]:
        import inspect

        from .. import tiny

        return sorted(p for p in inspect.signature(tiny.build_model).parameters if p not in ("kind", "tokenizer", "dtype"))

    return set(_cached("nested:model.tiny", read))


_NESTED_KEYS.update({("model", "quantization"): _bnb_keys, ("model", "tiny"): _tiny_keys})


# --- overrides ------------------------------------------------------------------------------------------------
def _unknown_key(key: str, keys: dict[str, list[str]], extra: str = "") -> RecipeError:
    """One line: the key, why, and the closest valid keys (all of them: `--print-config` or the section's class)."""
    dotted = [f"{s}.{k}" for s, ks in keys.items() for k in ks] + list(ALIASES)
    bare = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, dotted, n=3, cutoff=0.6)
    close += [d for d in difflib.get_close_matches(bare, [d.rsplit(".", 1)[-1] for d in dotted], n=3, cutoff=0.6)
              for d in [next(x for x in dotted if x.rsplit(".", 1)[-1] == d)] if d not in close]
    hint = f" Did you mean {' or '.join(close[:3])}?" if close else (
        f" Keys are section.key with sections {', '.join(SECTIONS)} (or a bare key that one section has).")
    elsewhere = _other_task_key(key, keys)
    if elsewhere:
        hint = elsewhere
    return RecipeError(f"unknown key {key!r}.{extra}{hint} (`--print-config` shows the recipe's keys; training.* takes "
                       "any field of the task's trainer config: AccumSFTConfig/AccumDPOConfig/AccumGRPOConfig/"
                       "AccumTrainingArguments for causal_lm/dpo/grpo/seq_cls, lora.* any peft.LoraConfig field)")


# The shipped recipes of each model.task, for "this key belongs to the DPO recipes".
TASK_RECIPES = {"causal_lm": "lora_sft or qlora_sft", "seq_cls": "lora_classification", "dpo": "lora_dpo",
                "grpo": "lora_grpo"}
_TASK_NAMES = {"causal_lm": "causal-LM (SFT)", "seq_cls": "classification", "dpo": "DPO", "grpo": "GRPO"}


def _other_task_key(key: str, keys: dict[str, list[str]]) -> str | None:
    """Where ``key`` is a training key of another task's recipes (`beta` on an SFT recipe): the sentence saying so."""
    section, _, name = key.rpartition(".")
    if section not in ("", "training"):
        return None
    current = next((t for t in TASKS if valid_keys(t) == keys), None)
    owners = [t for t in TASKS if t != current and name in valid_keys(t)["training"]]
    if current is None or not owners:
        return None
    return (f" {name} is a training key of the {' and '.join(_TASK_NAMES[t] for t in owners)} recipes (model.task="
            f"{'/'.join(owners)}: {', '.join(TASK_RECIPES[t] for t in owners)}), not of this {current} recipe's "
            f"trainer config; train one of those to set it, e.g. hf-accum train {TASK_RECIPES[owners[0]].split()[0]} "
            f"{key}=...")


# data keys that apply only to a trainer config without the field (seq_cls tokenizes itself; TRL's trainers truncate)
_DATA_KEYS_TRAINING_OWNS = ("max_length",)


def resolve_key(key: str, keys: dict[str, list[str]] | None = None) -> tuple[str, ...]:
    """`"lr"`-style bare keys, aliases and dotted keys -> a (section, field[, subfield]) path; unknown -> error."""
    keys = keys or valid_keys()
    key = ALIASES.get(key, key)
    parts = tuple(key.split("."))
    if len(parts) == 1:
        owners = [s for s, ks in keys.items() if parts[0] in ks]
        if parts[0] in _DATA_KEYS_TRAINING_OWNS and "training" in owners:
            owners = ["training"]  # the data key applies only where the trainer config has none (seq_cls)
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
    overrides = list(overrides)
    keys = valid_keys(task_of(config, overrides))
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
    sources: dict[str, str] = dataclasses.field(default_factory=dict)
    """section.key -> "recipe", "profile", "override", "machine" or "default" (hf_accum.recipes.profile)."""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self.data)
        if self.model.task != "seq_cls":
            del data["max_length"]  # TRL truncates: training.max_length (an error in data for these tasks)
        return {
            "model": dataclasses.asdict(self.model),
            "data": data,
            "lora": dict(self.lora),
            "training": dict(self.training),
        }

    def training_args(self):
        """The training section as `training_class(model.task)` (HfArgumentParser, no extra keys allowed)."""
        from transformers import HfArgumentParser

        with _quiet_deprecations():
            (args,) = HfArgumentParser(training_class(self.model.task)).parse_dict(self.training,
                                                                                   allow_extra_keys=False)
        return args

    def quantization_config(self):
        """`transformers.BitsAndBytesConfig` of `model.quantization` (None without); builds without bitsandbytes."""
        if self.model.quantization is None:
            return None
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(**self.model.quantization)

    def lora_config(self):
        from peft import LoraConfig

        kwargs = dict(self.lora)
        kwargs.setdefault("task_type", TASKS[self.model.task])
        return LoraConfig(**kwargs)

    def validate(self):
        """Build everything that needs no model: LoRA config, training arguments. Returns the arguments."""
        for section, build in (("model.quantization", self.quantization_config), ("lora", self.lora_config),
                               ("training", self.training_args)):
            try:
                out = build()
            except RecipeError:
                raise
            except (ValueError, TypeError, AttributeError) as exc:  # the classes' own checks name the field
                raise RecipeError(f"{section}: {' '.join(str(exc).split())}") from None
        return out


def load_recipe(recipe: str | os.PathLike | dict[str, Any], overrides: Sequence[str] = (), *,
                device: str | None = None) -> Recipe:
    """Read a recipe (name, path or mapping), apply its `tiny:` profile when the model is tiny, then the overrides,
    check every key and value that needs no model, and fill what the machine decides (``device``: "cuda"/"cpu"; None:
    this machine's). `Recipe.sources` says where each value came from (see `profile`)."""
    if isinstance(recipe, dict):
        name, path, config = "custom", None, recipe
    else:
        p = recipe_path(recipe)
        name, path, config = p.stem, str(p), read_yaml(p)
    config, tiny_profile = profile.split(config)
    keys = valid_keys(task_of(config, overrides))
    for section, values in tiny_profile.items():  # checked whichever model runs
        for key in values:
            resolve_key(f"{section}.{key}", keys)
    layers = {"recipe": profile.keys_of(config), "profile": set()}
    if profile.model_name(config, overrides) == profile.PROFILE:
        config = profile.merge(config, tiny_profile)
        layers["profile"] = profile.keys_of(tiny_profile)
    before = copy.deepcopy(config)
    config = apply_overrides(config, overrides)
    _steps_imply_strategy(config, overrides)
    _layers_override_the_flag(config, overrides)
    layers["override"] = {k for k in profile.keys_of(config) if k not in profile.keys_of(before)} | (
        profile.override_keys(resolve_key(o.split("=", 1)[0].strip(), keys) for o in overrides if "=" in o))
    keys = valid_keys(task_of(config))
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
    check_types(config)
    rules.check_values(config)
    task = task_of(config)
    if task != "seq_cls" and "max_length" in (config.get("data") or {}):
        raise RecipeError(f"data.max_length does not apply to model.task={task!r}: TRL tokenizes and truncates, so set "
                          "training.max_length instead")
    output_dir = (config.get("training") or {}).get("output_dir")
    if output_dir is not None:  # before the machine values, which ask torch about the device
        from .preflight import check_writable

        check_writable(str(output_dir))
    layers["machine"] = profile.fill_machine(config, device)
    model = ModelSection(**config.get("model", {}))
    data = DataSection(**config.get("data", {}))
    out = Recipe(name, path, model, data, dict(config.get("lora", {})), dict(config.get("training", {})))
    _check_sections(out)
    out.sources = profile.sources(out.to_dict(), **layers)
    return out


def wants_quantization(recipe: str | os.PathLike | dict[str, Any], overrides: Sequence[str] = ()) -> bool:
    """Whether the recipe, after overrides, has a quantized base; read without importing torch, transformers or
    peft, so the CLI can decide whether bitsandbytes may be imported at all."""
    config = recipe if isinstance(recipe, dict) else read_yaml(recipe_path(recipe))
    quantization = (config.get("model") or {}).get("quantization")
    for item in overrides:
        key, _, text = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if key in ("quantization", "model.quantization"):
            quantization = parse_value(text)
        elif key.startswith("model.quantization."):
            quantization = quantization if isinstance(quantization, dict) else {}
    return quantization is not None


def _steps_imply_strategy(config: dict[str, Any], overrides: Sequence[str]) -> None:
    """`save_steps=N` without `save_strategy=...` means "save every N steps", though the recipe says "no"; the same
    for `eval_steps=N` and `eval_strategy`."""
    keys = {item.split("=", 1)[0].strip() for item in overrides}
    for what in ("save", "eval"):
        if keys & {f"{what}_steps", f"training.{what}_steps"} and not keys & {f"{what}_strategy",
                                                                            f"training.{what}_strategy"}:
            config.setdefault("training", {})[f"{what}_strategy"] = "steps"


def _layers_override_the_flag(config: dict[str, Any], overrides: Sequence[str]) -> None:
    """`checkpoint_layers=K` on the command line wins over the recipe's `gradient_checkpointing: true` (every layer),
    as `save_steps` over `save_strategy`; the flag given on the command line too is the user's contradiction, and
    refused by the arguments."""
    keys = {item.split("=", 1)[0].strip() for item in overrides}
    flags = {"gradient_checkpointing", "activation_checkpointing"}
    flags |= {f"training.{f}" for f in flags}
    if keys & {"checkpoint_layers", "training.checkpoint_layers"} and not keys & flags:
        for flag in ("gradient_checkpointing", "activation_checkpointing"):
            (config.get("training") or {}).pop(flag, None)


def _section_classes(task: str = "causal_lm") -> dict[str, type]:
    from peft import LoraConfig

    return {"model": ModelSection, "data": DataSection, "lora": LoraConfig, "training": training_class(task)}


def field_specs(task: str = "causal_lm") -> dict[str, dict[str, list]]:
    """section -> key -> [its annotation as JSON (`values.encode`), its default]: what `rules.check_types` reads,
    cached with the keys (reading it imports the classes)."""
    def read() -> dict[str, dict[str, list]]:
        from .values import encode, field_types, plain_default

        out = {}
        for section, cls in _section_classes(task).items():
            defaults = {f.name: f.default for f in dataclasses.fields(cls)}
            out[section] = {key: [encode(hint), plain_default(defaults.get(key))]
                            for key, hint in field_types(cls).items()}
        return out

    return _cached(f"types:{task}", read)


def check_types(config: dict[str, Any]) -> None:
    """Every value has its field's type (`learning_rate=abc` is an error here, not a TypeError mid-run)."""
    rules.check_types(config, field_specs(task_of(config)))


def _check_sections(recipe: Recipe) -> None:
    """What `rules.RULES` cannot say as one key's values: the data file, and output_dir being set at all."""
    d = recipe.data
    _check_dataset_value(d)
    if "output_dir" not in recipe.training:
        raise RecipeError("training.output_dir is not set: add output_dir to the recipe or pass output_dir=DIR")


DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _check_dataset_value(d: DataSection) -> None:
    """What the name alone decides: a local file must exist and be of a kind `datasets` reads."""
    if d.dataset == "tiny":
        return
    path = Path(d.dataset)
    suffix = path.suffix.lower()
    known = ", ".join(DATA_FILE_BUILDERS)
    if suffix in DATA_FILE_BUILDERS and not path.is_file():
        raise RecipeError(f"data.dataset={d.dataset!r}: no such file; give an existing {known} file or a hub id")
    if path.is_file() and suffix not in DATA_FILE_BUILDERS:
        raise RecipeError(
            f"data.dataset={d.dataset!r} is a {suffix or 'suffix-less'} file; give a {known} file (JSON lines: one "
            "object per line), a dataset directory or a hub id"
        )


@contextlib.contextmanager
def _quiet_deprecations():
    # transformers 5.23 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs); recipes keep
    # the old names, the only ones transformers 5.17 (the oldest supported) knows, so the rename warning is noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning)
        yield


def format_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML, each key with its source as a comment (recipe, profile, override, machine,
    default): what `--print-config` prints and `recipe.yaml` in output_dir holds (it loads back as a recipe)."""
    import yaml

    lines = [f"# resolved recipe {recipe.name!r}" + (f" from {recipe.path}" if recipe.path else ""),
             "# source of each value: recipe (its file), profile (its tiny: section, for model tiny only), override "
             "(your key=value), machine (device, precision, budget), default (the section's own)"]
    for section, values in recipe.to_dict().items():
        lines.append(f"{section}:" + ("" if values else " {}"))
        for key, value in values.items():
            flow = isinstance(value, dict | list) and bool(value)  # a list or mapping on one line
            text = yaml.safe_dump({key: value}, default_flow_style=flow, width=10**6, sort_keys=False).strip()
            text = text.removeprefix("{").removesuffix("}") if flow else text
            lines.append(f"  {text}  # {recipe.sources.get(f'{section}.{key}', 'recipe')}")
    return "\n".join(lines) + "\n"


def write_recipe(recipe: Recipe, path: str) -> None:
    with open(path, "w") as f:
        f.write(format_recipe(recipe))
