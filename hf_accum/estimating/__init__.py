"""Estimates before anything loads: the probe on a model built from its config, on fake tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .estimate import CUDA_ASSUMPTIONS, Estimate, estimate_model


def estimate(model: str | Callable[[], Any], *, seq_len: int, target_batch_size: int, device: str | None = None,
             device_memory: int | str | None = None, lora_r: int | None = None, lora_target_modules: str | None = None,
             fused_loss: bool | None = None, **kwargs: Any) -> Estimate:
    """The plan for ``model`` (a folder holding config.json, a hub id, or a callable building the model; nothing is
    loaded) on ``device`` (default: this machine's) with ``device_memory`` (bytes or "80GiB"; default: this
    machine's, and required for cuda on a machine without a GPU: no card size is assumed); ``lora_r``: train LoRA
    adapters of that rank. ``fused_loss``: as the trainer's (None: the fused loss where the model allows it, its
    kernel's memory model). Other keywords as `estimate_model` (world_size, budget_bytes, budget_fraction, bf16,
    max_micro_batch, log)."""
    from .command import (
        config_builder,
        load_config,
        machine_device,
        machine_memory,
        parse_size,
        with_fused_loss,
        with_lora,
    )

    device = device or machine_device()
    if device_memory is None:
        device_memory = machine_memory(device, "device_memory")

    build = config_builder(load_config(model)) if isinstance(model, str) else model
    if lora_r is not None:
        build = with_lora(build, lora_r, lora_target_modules)
    build = with_fused_loss(build, fused_loss)
    memory = parse_size(device_memory) if isinstance(device_memory, str) else int(device_memory)
    return estimate_model(build, seq_len=seq_len, target_batch_size=target_batch_size, device_memory=memory,
                          device=device, **kwargs)


__all__ = ["CUDA_ASSUMPTIONS", "Estimate", "estimate", "estimate_model"]
