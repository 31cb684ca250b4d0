"""Selective activation checkpointing per decoder layer: a level between none and full, as a lever.

A selectively checkpointed layer keeps the outputs of its matrix products and attention (the expensive ops) and
recomputes the rest (norms, activations, rotary embeddings, dropout, casts) in the backward: torchtitan measured
-23% peak for +7% step time on a 1B Llama, against full recomputation's ~+28%. The policy goes to
`torch.utils.checkpoint.create_selective_checkpoint_contexts`, which needs the non-reentrant checkpoint; the RNG
state is replayed as for full checkpointing, so dropout draws the same masks and the gradient is unchanged.

Layers are laid out as the per-layer lever lays them out (the first layers recompute most): the first ``full`` of
them fully checkpointed, the next ``selective`` selectively, the rest not at all.

As a lever its levels are one chain of per-layer states along which memory falls and time grows: position p in
0..2L, p <= L: the first p layers selective (the rest none); p > L: the first p - L full, the rest selective. The
probe measures the anchors none (0), all selective (L) and all full (2L), stopping at the first that holds the window,
and `probing.level_choice.CheckpointChooser` interpolates between them. It contains the checkpointing lever's ends (none,
all full), so it is searched instead of it (``replaces``); a user's checkpointing setting other than "auto" keeps
it out of the search. Pinned with ``levers="selective=S"`` (S layers selective, after the
``levers="checkpointing=K"`` fully checkpointed ones), ``"selective=off"`` leaves the search to checkpointing alone.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..compat import gradient_checkpointing
from ..config.settings import Settings
from . import checkpointing
from .base import layer_count, pin

NAME = "selective"

_aten = torch.ops.aten
SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(_aten, name)
)


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep what a matrix product or attention computed; recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_function(kwargs: dict | None = None):
    """The layer's checkpoint call, the user's `torch.utils.checkpoint` kwargs kept (``preserve_rng_state``, ...)."""
    kwargs = dict(kwargs or {})
    if kwargs.pop("use_reentrant", False):
        raise ValueError("selective checkpointing needs the non-reentrant checkpoint, but gradient_checkpointing_kwargs "
                         "sets use_reentrant=True; drop it (or set it to False) to use the selective level")
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return functools.partial(checkpoint, use_reentrant=False, context_fn=context, **kwargs)


def set_layer_levels(model, full: int, selective: int, kwargs: dict | None = None) -> None:
    """The first ``full`` decoder layers fully checkpointed, the next ``selective`` selectively, the rest not."""
    layers = gradient_checkpointing.checkpointable_layers(model)
    if full < 0 or selective < 0 or full + selective > len(layers) or (selective and not layers):
        raise ValueError(f"{type(model).__name__} has {len(layers)} per-layer checkpointable decoder layers; cannot "
                         f"checkpoint {full} fully and {selective} selectively")
    function = checkpoint_function(kwargs) if selective else None  # refuses before the model is touched
    gradient_checkpointing.set_checkpointed_layers(model, full + selective, kwargs)
    for layer in layers[full:full + selective]:
        layer._gradient_checkpointing_func = function


@contextlib.contextmanager
def layer_levels(model, full: int, selective: int, kwargs: dict | None = None):
    """`set_layer_levels` for the block (a probe trial); every layer's checkpointing exactly as it was after it."""
    with gradient_checkpointing.checkpointed_layers(model, 0, kwargs):  # restores flags, functions and hooks on exit
        set_layer_levels(model, full, selective, kwargs)
        yield


def selective_count(model) -> int:
    """Decoder layers checkpointed selectively now."""
    return sum(bool(layer.gradient_checkpointing) and _is_selective(layer._gradient_checkpointing_func)
               for layer in gradient_checkpointing.checkpointable_layers(model))


def _is_selective(function) -> bool:
    context = getattr(function, "keywords", {}).get("context_fn")
    return getattr(context, "func", None) is create_selective_checkpoint_contexts


# --- the lever ----------------------------------------------------------------------------------------------------
def split(position: int, layers: int) -> tuple[int, int]:
    """(full, selective) layers at ``position`` of the chain 0..2L."""
    if not 0 <= position <= 2 * layers:
        raise ValueError(f"position {position} is outside 0..{2 * layers}")
    return (0, position) if position <= layers else (position - layers, 2 * layers - position)


@dataclass
class Levels:
    """The chain for the probe (`levers.base.Levels`): positions 0..2L, anchors none, all selective, all full."""

    model: object
    layers: int
    kwargs: dict
    name: str = NAME

    @property
    def count(self) -> int:
        return 2 * self.layers

    @property
    def anchors(self) -> tuple[int, ...]:
        return (0, self.layers, 2 * self.layers)

    def at(self, position: int):
        return layer_levels(self.model, *split(position, self.layers), self.kwargs)

    def record(self, position: int) -> dict[str, Any]:
        full, sel = split(position, self.layers)
        return {"full": full, "selective": sel, "of": self.layers}


def requested(args) -> str | int:
    """"auto" (the default), or S layers selective as pinned ("off": 0)."""
    value = pin(args, NAME)
    return "auto" if value is None else parse_pin(value)


def parse_pin(value: str) -> str | int:
    return layer_count(value, NAME, "layers checkpointed selectively")


def _full_pinned(args) -> int:
    want = checkpointing.requested(args)
    return want if isinstance(want, int) and not isinstance(want, bool) else 0


def check(model, args) -> None:
    """``selective=S``: a model with at least K + S per-layer checkpointable layers (K the fully checkpointed ones),
    non-reentrant checkpointing, and not every layer already fully checkpointed."""
    want = requested(args)
    if want == "auto" or want == 0:
        return
    if checkpointing.requested(args) is True:
        raise ValueError(f"levers: selective={want} and gradient_checkpointing=True (every layer fully) contradict each "
                         "other: pin the full ones with levers=\"checkpointing=K\" (or checkpoint_layers=K) instead")
    checkpoint_function(checkpointing.checkpoint_kwargs(args))  # refuses use_reentrant=True, naming it
    layers = len(gradient_checkpointing.checkpointable_layers(model))
    if _full_pinned(args) + want > layers:
        raise ValueError(f"levers: selective={want} with {_full_pinned(args)} layers fully checkpointed, but "
                         f"{type(model).__name__} has {layers} per-layer checkpointable decoder layers: pin at most "
                         f"{layers - _full_pinned(args)} selective layers")


def apply_requested(model, args) -> None:
    want = requested(args)
    if want != "auto" and want > 0:
        set_layer_levels(model, _full_pinned(args), want, checkpointing.checkpoint_kwargs(args))


def levels(trainer) -> Levels | None:
    """The chain, when selective and checkpointing are both "auto", the tuner runs, and the model has per-layer
    checkpointing that can run non-reentrant (else the checkpointing lever alone is searched)."""
    args = trainer.args
    if (requested(args) != "auto" or checkpointing.requested(args) != "auto" or not Settings(args).tunes
            or checkpointing.sharded_engine(trainer) is not None):  # the checkpointing lever says why, once
        return None
    layers = len(gradient_checkpointing.checkpointable_layers(trainer.model))
    kwargs = checkpointing.checkpoint_kwargs(args)
    if not layers or not gradient_checkpointing.can_checkpoint(trainer.model) or kwargs.get("use_reentrant"):
        return None
    return Levels(trainer.model, layers, kwargs)


REPLACES = (checkpointing.NAME,)  # its levels contain checkpointing's: one of the two is searched


def pinned_record(model, args) -> dict[str, Any] | None:
    want = requested(args)
    if want == "auto" or want == 0:
        return None
    layers = len(gradient_checkpointing.checkpointable_layers(model))
    return {"full": _full_pinned(args), "selective": want, "of": layers, "pinned": True}


def apply(model, record: dict[str, Any], args) -> None:
    if not record.get("pinned"):
        set_layer_levels(model, record["full"], record["selective"], checkpointing.checkpoint_kwargs(args))


def describe(record: dict[str, Any]) -> str:
    if not (record["full"] or record["selective"] or record.get("pinned")):
        return "no checkpointing"  # the plan line stays short; the record and figures keep the layer count
    return (f"checkpointing {record['full']} full + {record['selective']} selective of {record['of']} layers"
            + (" (as set)" if record.get("pinned") else ""))


def figures(record: dict[str, Any]) -> dict[str, Any]:
    return {"hf_accum/full_layers": record["full"], "hf_accum/selective_layers": record["selective"],
            "hf_accum/num_layers": record["of"]}
