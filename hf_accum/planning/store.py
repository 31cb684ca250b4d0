"""The plan file, `hf_accum_plan.json`, in `output_dir` and in each checkpoint: the key that says when a stored
plan can be reused without probing, reading it (`load_plan`, `read_plan_file`) and writing it (`save_plan`, called
by the `Planner` and by `restore_plan`, both in this wing; recipes and the CLI go through the planner).

The key holds everything that changes the memory of a step or the plan: device and capacity, model config and
attention implementation, sequence length, precision, LoRA / quantization, checkpointing, optimizer, the sharded
engine (DeepSpeed and its ZeRO stage), the
*requested* budget (a fraction of the memory usable at start, or bytes: never the bytes resolved from what other
processes happened to hold), the probe's cap, target, world size and the library versions. Any difference means
a new probe. `key_fields` builds it as one flat dict: adding a field is one line. `canonical` makes it JSON-stable
across processes (sets, such as peft's `target_modules`, are sorted: their order follows the hash seed).
"""

from __future__ import annotations

import enum
import json
import logging
import os
from importlib import metadata
from typing import Any

import torch

from ..compat import checkpoint_files, torch_features
from ..config.paths import PLAN_FILE
from ..config.settings import Settings
from ..levers.checkpointing import checkpointing_enabled
from ..probing.plan import OPTIONAL_FIELDS, Plan, indivisible_target, plan_for_micro

logger = logging.getLogger(__name__)

_PLAN_FIELDS = ("micro_batch_size", "gradient_accumulation_steps", "world_size", "target_batch_size")


class PlanFileError(ValueError):
    """A plan file exists but cannot be trusted; the message names the file and what is wrong."""


def requested_budget(args) -> dict[str, Any]:
    """The budget as the user asked for it: what the key stores."""
    if Settings(args).memory_budget_bytes is not None:
        return {"memory_budget_bytes": int(args.memory_budget_bytes)}
    return {"memory_budget": float(args.memory_budget)}


def key_fields(trainer, *, seq_len: int, capacity_bytes: int, device: str) -> dict[str, Any]:
    """Everything the plan depends on, one line each."""
    args, model = trainer.args, trainer.model
    config = getattr(model, "config", None)
    peft_config = getattr(model, "peft_config", None)
    return {
        "device": device,
        "capacity_bytes": int(capacity_bytes),
        "model_class": type(model).__name__,
        "model_config": config.to_diff_dict() if config is not None else None,
        "attn_implementation": torch_features.attn_implementation(model),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peft": {k: v.to_dict() for k, v in peft_config.items()} if peft_config else None,
        "seq_len": int(seq_len),
        "bf16": bool(args.bf16),
        "fp16": bool(args.fp16),
        "gradient_checkpointing": checkpointing_enabled(args),
        "checkpoint_layers": Settings(args).checkpoint_layers,  # the request ("auto", k); the plan holds k
        "levers": Settings(args).levers,  # pinned levers as given ("selective=4"); the plan holds what was chosen
        "fused_loss": bool(getattr(trainer, "fused_loss_active", False)),
        "optim": str(args.optim),
        "optim_args": args.optim_args,
        "max_grad_norm": args.max_grad_norm,
        "budget": requested_budget(args),
        "probe_max_micro_batch": args.probe_max_micro_batch,
        "target_batch_size": args.target_batch_size,
        "world_size": args.world_size,
        "engine": trainer.engine.label,
        "optimize": args.auto_tune_optimize,
        "micro_batching": args.micro_batching,
        "versions": {name: library_version(name) for name in libraries_that_matter(model)},
    }


def libraries_that_matter(model) -> tuple[str, ...]:
    """The packages whose version can change this model's step memory: peft only for a PEFT model, bitsandbytes
    only for a quantized one (installing it must not re-probe a run that never uses it)."""
    names = ["hf-accum", "torch", "transformers"]
    if isinstance(getattr(model, "peft_config", None), dict):
        names.append("peft")
    quantized = getattr(getattr(model, "config", None), "quantization_config", None) is not None or any(
        type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules())
    if quantized:
        names.append("bitsandbytes")
    return tuple(names)


def plan_key(trainer, *, seq_len: int, capacity_bytes: int, device: str) -> dict[str, Any]:
    """The key, canonical: equal in every process that would measure the same memory."""
    return canonical(key_fields(trainer, seq_len=seq_len, capacity_bytes=capacity_bytes, device=device))


def canonical(value: Any) -> Any:
    """``value`` as plain JSON data that does not depend on the process: dict keys sorted, sets sorted,
    tuples as lists, enums by value, anything else JSON cannot hold as its ``str``."""
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        items = [canonical(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def library_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return torch.__version__ if name == "torch" else None


# --- reading ---------------------------------------------------------------------------------------------
def plan_from_record(record: Any, path: str) -> Plan:
    """The plan of a parsed plan file; PlanFileError naming ``path`` when it is not a valid plan."""
    plan = record.get("plan") if isinstance(record, dict) else None
    if not isinstance(plan, dict):
        raise PlanFileError(f"{path} has no \"plan\" object")
    missing = [f for f in _PLAN_FIELDS if f not in plan]
    if missing:
        raise PlanFileError(f"{path}: the plan lacks {', '.join(missing)}")
    for name in _PLAN_FIELDS:
        value = plan[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanFileError(f"{path}: {name}={value!r} is not a positive integer")
    optional = {name: plan[name] for name in OPTIONAL_FIELDS if plan.get(name) is not None}
    if plan.get("checkpointed_layers") is not None and "levers" not in optional:  # a plan file before the levers
        optional["levers"] = {"checkpointing": {"layers": plan["checkpointed_layers"], "of": plan.get("num_layers")}}
    try:
        return Plan(**{name: plan[name] for name in _PLAN_FIELDS}, **optional)
    except ValueError as exc:
        raise PlanFileError(f"{path}: {exc}") from None


def read_plan_file(folder: str) -> tuple[Plan, dict[str, Any]] | None:
    """The plan in ``folder`` and the whole record; None when there is no plan file; PlanFileError naming the
    file when it is unreadable or invalid."""
    path = os.path.join(folder, PLAN_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PlanFileError(f"{path} cannot be read as JSON ({exc})") from None
    return plan_from_record(record, path), record


def stored_probe(folder: str) -> dict[str, Any] | None:
    """What the probe measured, as stored in ``folder``'s plan file (a run that reused it reports it); None when
    there is no readable plan file."""
    try:
        with open(os.path.join(folder, PLAN_FILE)) as f:
            return json.load(f).get("probe") or {}
    except (OSError, ValueError):
        return None


def stored_figures(checkpoint: str) -> dict[str, float] | None:
    """The figures the first log entry of the run that wrote ``checkpoint`` carries (or will carry: a checkpoint
    saved before any log entry has an empty history, and its resumed run logs these, not its own, so its
    `log_history` is the uninterrupted run's); None when its plan file has none (written before they were kept)."""
    try:
        with open(os.path.join(checkpoint, PLAN_FILE)) as f:
            figures = json.load(f).get("figures")
    except (OSError, ValueError, AttributeError):
        return None
    return dict(figures) if isinstance(figures, dict) else None


def load_stored_plan(folder: str) -> Plan | None:
    """The plan stored in ``folder`` (an output_dir or a checkpoint), whatever its key; None when absent.
    Raises PlanFileError when a plan file is there but corrupt or invalid: never silently ignored."""
    found = read_plan_file(folder)
    return None if found is None else found[0]


def load_plan(output_dir: str, key: dict[str, Any]) -> tuple[Plan, dict[str, Any]] | None:
    """The stored plan and its record if its key equals ``key``; None when absent or stale. Raises
    PlanFileError when the file is corrupt or its plan invalid (the caller decides: warn and probe again)."""
    found = read_plan_file(output_dir)
    if found is None:
        return None
    plan, record = found
    key = canonical(key)
    if record.get("key") != key:
        changed = key_changes(record.get("key"), key)
        logger.warning("hf_accum: the plan stored in %s is not reused: %s changed since it was probed; probing "
                       "again.", os.path.join(output_dir, PLAN_FILE), changed)
        return None
    return plan, record


def key_changes(old: Any, new: Any, shown: int = 3) -> str:
    """Which parts of a plan key differ, as "versions.bitsandbytes (absent -> '0.50.2'), seq_len (256 -> 512)"."""
    found: list[str] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for name in sorted(set(a) | set(b)):
                walk(a.get(name, _ABSENT), b.get(name, _ABSENT), f"{path}.{name}" if path else name)
        elif a != b:
            found.append(f"{path or 'the key'} ({_short(a)} -> {_short(b)})")

    walk(old, new, "")
    more = f" and {len(found) - shown} more" if len(found) > shown else ""
    return ", ".join(found[:shown]) + more if found else "nothing"


_ABSENT = object()


def _short(value: Any) -> str:
    text = "absent" if value is _ABSENT else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def save_plan(output_dir: str, key: dict[str, Any], plan: Plan, probe: dict[str, Any] | None,
              figures: dict[str, float] | None = None) -> str:
    """``figures``: in a checkpoint's plan file, those its run's first log entry carries (`stored_figures`)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, PLAN_FILE)
    tmp = path + ".tmp"
    record = {"plan": plan.to_dict(), "key": canonical(key), "probe": canonical(probe)}
    if figures is not None:
        record["figures"] = canonical(figures)
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # never leave a half-written plan behind
    return path


def restore_plan(checkpoint: str, world_size: int = 1) -> Plan:
    """Write back the plan file of a checkpoint that lost it, from the target its saved arguments hold.

    The micro-batch is the one the run started with, at most the per-rank target (any cut of a window gives the
    same optimizer steps; only the target matters for exactness). Returns the plan."""
    saved = checkpoint_files.saved_training_args(checkpoint) or {}
    target = saved.get("target_batch_size")
    if not isinstance(target, int) or isinstance(target, bool) or target < 1:
        raise ValueError(f"{checkpoint}: its training_args.bin holds no target_batch_size; nothing to restore from.")
    problem = indivisible_target(target, world_size)
    if problem:
        raise ValueError(f"{checkpoint}: {problem}.")
    per_rank = target // world_size
    started = saved.get("per_device_train_batch_size")
    cap = started if isinstance(started, int) and started > 0 else per_rank
    plan = plan_for_micro(target, world_size, min(cap, per_rank))
    save_plan(checkpoint, {"restored_from": "training_args.bin"}, plan, None)
    logger.warning("hf_accum: wrote %s: %s", os.path.join(checkpoint, PLAN_FILE), plan.describe())
    return plan
