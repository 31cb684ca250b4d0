"""Activation offload per decoder layer as a lever, CUDA only (the mechanics: `hf_accum.levers.activation_offload`, save_on_cpu around
each chosen layer's forward; exact, the copies are bitwise).

Pinned with ``levers="offload=K"``: the K decoder layers after the fully and selectively checkpointed ones keep what
they save for the backward in pinned host memory. The probe does not search it yet: where it pays against
recomputing is measured by bench_gpu's levers section first, so "auto" leaves it off and the probe log says so in one
line, on CPU the reason it is absent (activations already live in host memory). The plan records a pin as
``{"layers": K, "of": L, "pinned": true}``.
"""

from __future__ import annotations

import logging
from typing import Any

from ..compat import gradient_checkpointing
from . import activation_offload as offload
from . import checkpointing, selective
from .base import layer_count, pin

logger = logging.getLogger(__name__)

NAME = "offload"


def parse_pin(value: str) -> str | int:
    return layer_count(value, NAME, "decoder layers to offload")


def requested(args) -> str | int:
    value = pin(args, NAME)
    return "auto" if value is None else parse_pin(value)


def _before(args) -> tuple[int, int]:
    """The pinned (full, selective) layers the offloaded ones come after."""
    full = checkpointing.requested(args)
    sel = selective.requested(args)
    return (full if isinstance(full, int) and not isinstance(full, bool) else 0,
            sel if isinstance(sel, int) else 0)


def check(model, args) -> None:
    want = requested(args)
    if want == "auto" or want == 0:
        return
    why = offload.why_unavailable(args.device)
    if why is not None:
        raise ValueError(f"levers: offload={want}, but {why}: drop offload from levers")
    full, sel = _before(args)
    layers = len(gradient_checkpointing.checkpointable_layers(model))
    if full + sel + want > layers:
        raise ValueError(f"levers: offload={want} after {full + sel} checkpointed layers, but {type(model).__name__} "
                         f"has {layers} decoder layers: pin at most {max(0, layers - full - sel)}")


def apply_requested(model, args) -> None:
    want = requested(args)
    if want != "auto" and want > 0:
        layers = len(gradient_checkpointing.checkpointable_layers(model))
        offload.set_offloaded_layers(model, offload.layout(layers, *_before(args), want))


def levels(trainer) -> None:
    """Not searched (see the module docstring): one probe-log line says why."""
    why = offload.why_unavailable(trainer.args.device)
    logger.info("hf_accum: %s", why or "activation offload is not chosen by the probe yet: pin it with "
                                       "levers=\"offload=K\"")
    return None


def pinned_record(model, args) -> dict[str, Any] | None:
    want = requested(args)
    if want == "auto" or want == 0:
        return None
    return {"layers": want, "of": len(gradient_checkpointing.checkpointable_layers(model)), "pinned": True}


def apply(model, record: dict[str, Any], args) -> None:
    """Only pins are recorded, and a pin is applied from the request (`apply_requested`)."""


def describe(record: dict[str, Any]) -> str:
    return f"offload {record['layers']} of {record['of']} layers" + (" (as set)" if record.get("pinned") else "")


def figures(record: dict[str, Any]) -> dict[str, Any]:
    return {"hf_accum/offloaded_layers": record["layers"]}
