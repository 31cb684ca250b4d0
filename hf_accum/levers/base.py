"""What a lever is, and the registry that holds them (PEFT's `register_peft_method` is the model).

A lever trades memory for step time: gradient checkpointing per layer, selective checkpointing, activation offload.
The probe chooses its level by measured step time within the budget, unless the user pinned it; either way the plan
records it. Everything lever-specific lives in the lever's own module; the probe (`probing.levels.probe_levels`), the
plan (`probing.plan.Plan.levers`), the plan file, the planner and the logged figures iterate the registered levers
through this protocol and name none of them. Adding one: its file, its tests, one `register_lever` line in
`levers/__init__.py`, and its docs (docs/development.md, "Adding a lever").

A plan record is a small dict of plain JSON numbers, ``{"layers": 2, "of": 4}``: every integer but ``of`` counts
layers at some level, so their sum is at most ``of`` (`probing.plan.Plan` checks that much; the lever's own
``check_record`` the rest). ``"pinned": true`` marks a level the user set (recorded, not chosen).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any, Protocol

from ..config.settings import Settings


class Levels(Protocol):
    """A lever's levels on one model, for the probe: positions ``0..count``, memory not growing and time not falling
    as the position grows (0: the lever off). The probe measures the ``anchors`` (0 first, ``count`` last) and
    interpolates between them (`probing.level_choice.CheckpointChooser`)."""

    name: str  # the lever's name
    count: int  # the last position
    anchors: tuple[int, ...]  # the positions the probe measures, in order (it stops at the first that fits)

    def at(self, position: int) -> AbstractContextManager:
        """A context applying ``position`` to the model for a trial, restoring the model on exit."""

    def record(self, position: int) -> dict[str, Any]:
        """The plan's record of ``position``."""


class Lever(Protocol):
    """One lever: what the user asked for, checks, levels, applying them, and what the plan says of them."""

    name: str  # the plan's record key, the pin's name in ``levers="name=value"``, the figures' prefix
    replaces: tuple[str, ...]  # levers whose levels this one's contain: searched instead of them

    def requested(self, args) -> Any:
        """What the user asked for: "auto" (the probe chooses), a level as given, or False (off)."""

    def parse_pin(self, value: str) -> Any:
        """A ``levers="name=value"`` value as a request; ValueError naming it and the fix when it is not one."""

    def check(self, model, args) -> None:
        """Refuse, at trainer construction, a request the model cannot take: one error naming what to set."""

    def apply_requested(self, model, args) -> None:
        """An explicit request set on the model before the probe (it measures what training runs)."""

    def pinned_record(self, model, args) -> dict[str, Any] | None:
        """The plan's record of an explicit request (``"pinned": True``); None when not pinned."""

    def levels(self, trainer) -> Levels | None:
        """The levels the probe may choose from, when the request is "auto" and the model can; else None."""

    def apply(self, model, record: dict[str, Any], args) -> None:
        """A plan's record (chosen by a probe, maybe stored) set on the model; idempotent."""

    def describe(self, record: dict[str, Any]) -> str:
        """The plan line's words: "checkpointing 2 of 4 layers"."""

    def figures(self, record: dict[str, Any]) -> dict[str, Any]:
        """The logged figures, ``hf_accum/...`` names."""


_REGISTRY: dict[str, Lever] = {}


HOOKS = ("requested", "parse_pin", "check", "apply_requested", "levels", "pinned_record", "apply", "describe",
         "figures")


def module_lever(module) -> Lever:
    """The registry's entry for a lever written as a module: its ``NAME``, its ``REPLACES`` (default none) and
    its functions named as the protocol's hooks."""
    return SimpleNamespace(name=module.NAME, replaces=getattr(module, "REPLACES", ()),
                           **{hook: getattr(module, hook) for hook in HOOKS})


def register_lever(lever: Lever) -> Lever:
    """Add ``lever`` to the registry (one line per lever in `levers/__init__.py`); its name must be new."""
    if lever.name in _REGISTRY and _REGISTRY[lever.name] is not lever:
        raise ValueError(f"a lever named {lever.name!r} is already registered")
    _REGISTRY[lever.name] = lever
    return lever


def registered() -> list[Lever]:
    """The registered levers, in registration order."""
    return list(_REGISTRY.values())


def get_lever(name: str) -> Lever:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"levers: no lever named {name!r}; the registered levers are {', '.join(_REGISTRY)}") from None


def searched(trainer, say: Callable[[str], None] | None = None) -> Levels | None:
    """The levels the probe searches for ``trainer``: of the levers whose request is "auto" and whose levels exist,
    the one no other replaces (a lever pinned by the user keeps the ones it replaces from being searched too: they
    would rewrite the layers it set). None when no lever is searched."""
    args = trainer.args
    pinned = {lv.name for lv in registered() if lv.requested(args) not in ("auto", False, None, 0)}
    held = {name for lv in registered() if lv.name in pinned for name in lv.replaces}
    found = {}
    for lever in registered():
        if lever.name in held or lever.name in pinned:
            continue
        levels = lever.levels(trainer)
        if levels is not None:
            found[lever.name] = (lever, levels)
    replaced = {name for lever, _ in found.values() for name in lever.replaces}
    left = [levels for name, (_, levels) in found.items() if name not in replaced]
    return left[-1] if left else None


def check_requests(model, args) -> None:
    """Every lever's request checked against the model (trainer construction)."""
    for lever in registered():
        lever.check(model, args)


def apply_requested(model, args) -> None:
    """Every lever's explicit request set on the model (before a probe, and as training starts)."""
    for lever in registered():
        lever.apply_requested(model, args)


def pinned_records(model, args) -> dict[str, dict[str, Any]]:
    """The plan's records of the levers the user set explicitly."""
    out = {}
    for lever in registered():
        record = lever.pinned_record(model, args)
        if record is not None:
            out[lever.name] = record
    return out


def parse_pins(text: str | None) -> dict[str, str]:
    """``levers="selective=4,checkpointing=2"`` as ``{"selective": "4", "checkpointing": "2"}``; ValueError naming
    the field and the fix on anything else (the names are checked against the registry where the levers are known)."""
    pins: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(f"levers={text!r}: give comma-separated name=value pairs, e.g. levers=\"checkpointing=2\" "
                             "(a value is 'auto', 'off' or the lever's level)")
        if name in pins:
            raise ValueError(f"levers={text!r} pins {name} twice: give each lever once")
        pins[name] = value
    return pins


def check_pins(text: str | None) -> None:
    """``levers=...`` checked against the registry: known names, values each lever can take (`AccumTrainingArguments`
    calls it in ``__post_init__``)."""
    for name, value in parse_pins(text).items():
        get_lever(name).parse_pin(value)


def layer_count(value: str, name: str, what: str) -> str | int:
    """A per-layer lever's pin: "auto", "off" (0) or a number of layers; ValueError naming it otherwise."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text == "off" or text.isdigit():
        return int(text) if text.isdigit() else 0
    raise ValueError(f"levers: {name}={value!r} must be 'auto', 'off' or the number of {what} (an integer >= 0)")


def pin(args, name: str) -> str | None:
    """The value the user pinned lever ``name`` to in ``levers=...`` (None: not pinned there)."""
    return parse_pins(Settings(args).levers).get(name)
