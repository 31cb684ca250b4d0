"""The recipe files: where recipes are found (the packaged copy, then the repository's `recipes/`), reading one as
YAML 1.2 means it, and the error every recipe problem raises. Needs neither torch nor transformers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

SECTIONS = ("model", "data", "lora", "training")

_HERE = Path(__file__).resolve().parent  # hf_accum/recipes/
# hf_accum/recipes/yaml: a wheel's copy of recipes/, in a checkout a symlink to it; recipes/ itself for a checkout
# whose git wrote the symlink as a plain file (core.symlinks=false).
RECIPE_DIRS = (_HERE / "yaml", _HERE.parent.parent / "recipes")


class RecipeError(ValueError):
    """A recipe or an override that cannot be used; the message names the key and what to set instead."""


# --- YAML ---------------------------------------------------------------------------------------------------
def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """PyYAML follows YAML 1.1, where `1e-4` is a string and `no` / `off` are false; recipes mean what YAML 1.2
        means: the float, and the strings (`save_strategy=no`)."""

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
    )
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
        try:
            data = yaml.load(f, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise RecipeError(f"recipe file {str(path)!r}{where}: not valid YAML ({problem}); fix that line") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping with sections {list(SECTIONS)}, not {type(data).__name__}")
    return data


# --- finding a recipe ---------------------------------------------------------------------------------------
def recipe_dirs() -> list[Path]:
    """The folders that hold recipes here: the installed package's copy (a wheel has no repository `recipes/`)."""
    return [d for d in RECIPE_DIRS if d.is_dir()]


def available_recipes() -> list[str]:
    names: set[str] = set()
    for d in RECIPE_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def recipe_path(recipe: str | os.PathLike) -> Path:
    """The YAML file of a recipe name (from the shipped recipes) or a path."""
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") or p.is_file():  # a folder named like a recipe (its output_dir) is not one
        if not p.is_file():
            raise RecipeError(f"recipe file {str(p)!r} does not exist; known recipes: {', '.join(available_recipes())}")
        return p
    for d in RECIPE_DIRS:
        candidate = d / f"{recipe}.yaml"
        if candidate.is_file():
            return candidate
    raise RecipeError(
        f"unknown recipe {str(recipe)!r}: give one of {', '.join(available_recipes()) or '(none found)'} "
        f"or the path of a YAML file (the recipes are in {recipe_dirs()[0] if recipe_dirs() else 'no folder'})"
    )
