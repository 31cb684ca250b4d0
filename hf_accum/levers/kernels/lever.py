"""The ``loss_kernel`` lever: which loss kernel the fused loss runs (hf_accum/levers/kernels/). Unlike the layer levers it
has no levels to search: the probe times every kernel that runs on the device at the planned micro-batch
(`probe.time_kernels`) and the plan records ``{"kernel": NAME, "seconds": {...}, "peak_bytes": {...}}``; in
``micro_batching="tokens"`` the token budget is measured under each and the plan records the kernel whose whole steps
model least (`window.kernel_budget.choose_kernel`: ``step_seconds``, ``forwards_per_step``, ...);
``levers="loss_kernel=NAME"`` pins one (checked here before any model work), ``use_liger_kernel=True`` pins
``liger`` (Liger's own loss patch off: `liger.route`), ``fused_loss=False`` turns the fused loss, and so this lever,
off. Its records are applied to the installed fused-loss patch (`FusedLossPatch.kernel`).
"""

from __future__ import annotations

from typing import Any

from ...config.settings import Settings
from . import base, liger

NAME = "loss_kernel"


def parse_pin(value: str) -> str:
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        return base.get(text).NAME
    except ValueError:
        names = ", ".join(k.NAME for k in base.registered())
        raise ValueError(f"levers: loss_kernel={value!r} names no loss kernel; give 'auto' or one of {names}") from None


def requested(args) -> Any:
    if Settings(args).fused_loss is False:
        return False
    from ..base import pin

    value = pin(args, NAME)
    if value is None and args.use_liger_kernel:  # Liger's loss runs in our fused loss, its own patch off (liger.route)
        return liger.NAME
    return "auto" if value is None else parse_pin(value)


def _where(model, args) -> tuple[str, Any, bool]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = head.weight if head is not None else next(model.parameters())
    return weight.device.type, weight.dtype, bool(args.bf16 or args.fp16)


def check(model, args) -> None:
    """A pinned kernel must run on the model's device and dtype and compute the loss asked for; with
    fused_loss=False a pin has nothing to run."""
    value = parse_pins_value(args)
    if value is None or value == "auto":
        return
    if Settings(args).fused_loss is False:
        raise ValueError(f'levers="loss_kernel={value}" pins a fused-loss kernel, but fused_loss=False; drop the pin '
                         "or leave fused_loss unset")
    device, dtype, autocast = _where(model, args)
    why = base.unavailable(value, device, dtype, autocast)
    if why is not None:
        runs = ", ".join(base.runnable(device, dtype, autocast))
        raise ValueError(f'levers="loss_kernel={value}": the loss kernel cannot run here: {why}. Pin one that runs '
                         f"({runs}) or drop the pin to let the probe choose")
    base.refuse_settings(value, Settings(args).label_smoothing_factor)


def parse_pins_value(args) -> str | None:
    from ..base import pin

    value = pin(args, NAME)
    return None if value is None else parse_pin(value)


def _patch(model):
    from .fused_loss import installed_patch

    return installed_patch(model)


def apply_requested(model, args) -> None:
    value = requested(args)
    patch = _patch(model)
    if patch is not None and value not in ("auto", False):
        patch.kernel = value


def pinned_record(model, args) -> dict[str, Any] | None:
    value = requested(args)
    if value in ("auto", False) or _patch(model) is None:  # no fused-loss patch (e.g. TRL's own head): no kernel
        return None
    if parse_pins_value(args) is None:  # not in `levers`: use_liger_kernel=True chose it
        return {"kernel": value, "pinned": True, "by": "use_liger_kernel=True"}
    return {"kernel": value, "pinned": True}


def levels(trainer) -> None:
    return None  # not a level search: the probe times the kernels itself (probe.time_kernels)


def apply(model, record: dict[str, Any], args) -> None:
    patch = _patch(model)
    if patch is not None:
        patch.kernel = record["kernel"]


def describe(record: dict[str, Any]) -> str:
    if record.get("pinned"):
        return f"loss kernel {record['kernel']} ({record.get('by', 'pinned')})"
    if record.get("micro_batching") == "tokens":  # chosen with the token budget, by whole steps (window/kernel_budget.py)
        how = "least modelled step time" if record.get("by") == "step time" else "fewest forwards"
        return f"loss kernel {record['kernel']} ({how} of {len(record.get('tokens_per_forward') or {})})"
    timed = record.get("seconds")  # the times themselves are in the plan file: the line stays short
    return f"loss kernel {record['kernel']}" + (" (fastest)" if timed else "")


def figures(record: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {f"hf_accum/loss_kernel/{record['kernel']}": 1}
    out.update({f"hf_accum/loss_kernel_seconds/{k}": v for k, v in (record.get("seconds") or {}).items()})
    out.update({f"hf_accum/loss_kernel_step_seconds/{k}": v for k, v in (record.get("step_seconds") or {}).items()})
    return out
