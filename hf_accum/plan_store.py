"""The plan written to `output_dir`, and the key that says when it can be reused without probing.

The key holds everything that changes the memory of a step or the plan: device and capacity, model config,
sequence length, precision, LoRA / quantization, checkpointing, optimizer, budget, target, world size and the
library versions. Any difference means a new probe.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from typing import Any

import torch

from .plan import Plan

PLAN_FILE = "hf_accum_plan.json"


def plan_key(trainer, *, seq_len: int, budget_bytes: int, capacity_bytes: int, device: str) -> dict[str, Any]:
    args, model = trainer.args, trainer.model
    config = getattr(model, "config", None)
    peft_config = getattr(model, "peft_config", None)
    return {
        "device": device,
        "capacity_bytes": int(capacity_bytes),
        "model_class": type(model).__name__,
        "model_config": config.to_diff_dict() if config is not None else None,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peft": {k: v.to_dict() for k, v in peft_config.items()} if peft_config else None,
        "seq_len": int(seq_len),
        "bf16": bool(args.bf16),
        "fp16": bool(args.fp16),
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "fused_loss": bool(getattr(trainer, "fused_loss_active", False)),
        "optim": str(args.optim),
        "optim_args": args.optim_args,
        "max_grad_norm": args.max_grad_norm,
        "budget_bytes": int(budget_bytes),
        "target_batch_size": args.target_batch_size,
        "world_size": args.world_size,
        "optimize": args.auto_tune_optimize,
        "versions": {name: _version(name) for name in ("hf-accum", "torch", "transformers", "peft", "bitsandbytes")},
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return torch.__version__ if name == "torch" else None


def _jsonable(value):
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def load_stored_plan(folder: str) -> Plan | None:
    """The plan stored in ``folder`` (an output_dir or a checkpoint), whatever its key."""
    try:
        with open(os.path.join(folder, PLAN_FILE)) as f:
            return Plan(**json.load(f)["plan"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_plan(output_dir: str, key: dict[str, Any]) -> Plan | None:
    """The stored plan if its key equals ``key``; None when absent, unreadable or stale."""
    path = os.path.join(output_dir, PLAN_FILE)
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return None
    if stored.get("key") != _jsonable(key):
        return None
    return Plan(**stored["plan"])


def save_plan(output_dir: str, key: dict[str, Any], plan: Plan, probe: dict[str, Any] | None) -> str:
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, PLAN_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"plan": plan.to_dict(), "key": _jsonable(key), "probe": _jsonable(probe)}, f, indent=2)
    os.replace(tmp, path)  # never leave a half-written plan behind
    return path
