"""Whether a recipe value has the type its dataclass field declares, and how to say so when it does not.

A recipe's values come from YAML (`1e-4` is a float, `abc` a string); the dataclasses they fill
(`AccumTrainingArguments`, `peft.LoraConfig`, the model and data sections) do not check types themselves, so a
string learning rate would fail later with a TypeError deep inside training. Pure functions, tested with a table.
"""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

_UNION_TYPES = (typing.Union, types.UnionType)


def field_types(cls) -> dict[str, Any]:
    """The resolved annotation of every field of the dataclass ``cls``; a field that cannot be resolved is left
    out (and so not checked)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation naming something not importable here: check field by field
        pass
    import dataclasses
    import sys

    out = {}
    for f in dataclasses.fields(cls):
        for klass in cls.__mro__:
            if f.name in getattr(klass, "__annotations__", {}):
                try:
                    hint = f.type
                    if isinstance(hint, str):
                        hint = eval(hint, vars(sys.modules[klass.__module__]))  # noqa: S307 (annotations only)
                    out[f.name] = hint
                except Exception:
                    pass
                break
    return out


def fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` (parsed YAML: None, bool, int, float, str, list, dict) is acceptable for ``hint``.
    Unknown kinds of annotation accept anything: this check only refuses what is certainly wrong."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNION_TYPES:
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums and str in args and isinstance(value, str):  # `Enum | str`: the string names a member
            return any(value in [m.value for m in e] for e in enums)
        return any(fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in [m.value for m in hint]
    container = origin or hint
    if container in (list, tuple, set, frozenset, typing.Sequence) or (
        isinstance(container, type) and container.__module__ == "collections.abc" and container.__name__ in (
            "Sequence", "Iterable", "Collection")):
        if not isinstance(value, list | tuple):
            return False
        item = args[0] if args and args[0] is not Ellipsis else Any
        return all(fits(v, item) for v in value)
    if container is dict or (isinstance(container, type) and container.__name__ == "Mapping"):
        return isinstance(value, dict)
    return True


def describe(hint: Any) -> str:
    """``hint`` in words: "a float", "an integer or null", "one of 'linear', 'cosine', ..."."""
    if hint is None or hint is type(None):
        return "null"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNION_TYPES:
        if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args) and str in args:
            args = tuple(a for a in args if a is not str)
        # Sorted: typing caches a Union by its set of members, so their order depends on which was built first.
        parts = sorted(describe(a) for a in args if a is not type(None))
        parts += ["null"] if type(None) in args else []
        return " or ".join(dict.fromkeys(parts))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        return "one of " + ", ".join(repr(v) for v in values[:8]) + (", ..." if len(values) > 8 else "")
    container = origin or hint
    if container is dict:
        return "a mapping"
    if container in (list, tuple, set, frozenset) or getattr(container, "__name__", "") in ("Sequence", "Iterable"):
        return "a list" + (f" of {describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args and
                           args[0] in names else "")
    return getattr(hint, "__name__", str(hint))


def kind(value: Any) -> str:
    """What YAML made of a value, in the words of :func:`describe`."""
    if value is None:
        return "null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__)


# --- the same annotations as JSON: cached with the recipe keys, so a wrong value is told without importing the
# classes (transformers, TRL, peft: seconds). `decode(encode(hint))` fits and is described as ``hint`` is.
_SCALARS = {bool: "bool", int: "int", float: "float", str: "str"}
_SEQUENCES = ("Sequence", "Iterable", "Collection")


def encode(hint: Any) -> Any:
    """``hint`` as JSON data (see :func:`decode`); a class this module does not know becomes its name."""
    if hint is Any or hint is object:
        return "any"
    if hint is None or hint is type(None):
        return "null"
    if hint in _SCALARS:
        return _SCALARS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNION_TYPES:
        return {"union": [encode(a) for a in args]}
    if origin is typing.Literal:
        return {"literal": list(args)}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum": hint.__name__, "values": [m.value for m in hint]}
    container = origin or hint
    if container in (list, tuple, set, frozenset) or getattr(container, "__name__", "") in _SEQUENCES:
        return {"list": encode(args[0]) if args and args[0] is not Ellipsis else None}
    if container is dict or getattr(container, "__name__", "") == "Mapping":
        return "dict"
    return {"class": getattr(hint, "__name__", str(hint))}


def decode(spec: Any) -> Any:
    """The annotation :func:`encode` wrote: the same answers from :func:`fits` and :func:`describe`."""
    named = {"any": Any, "null": type(None), "dict": dict, **{v: k for k, v in _SCALARS.items()}}
    if isinstance(spec, str):
        return named[spec]
    if "union" in spec:
        return typing.Union[tuple(decode(s) for s in spec["union"])]  # noqa: UP007 (built from a list)
    if "literal" in spec:
        return typing.Literal[tuple(spec["literal"])]
    if "enum" in spec:
        return enum.Enum(spec["enum"], [(f"m{i}", v) for i, v in enumerate(spec["values"])])
    if "list" in spec:
        return list if spec["list"] is None else list[decode(spec["list"])]
    return type(spec["class"], (), {})  # unknown: fits anything, described by its name


def plain_default(default: Any) -> Any:
    """A field's default as JSON data (an enum by its value); None where it is not a scalar."""
    if isinstance(default, enum.Enum):
        default = default.value
    return default if isinstance(default, bool | int | float | str) else None
