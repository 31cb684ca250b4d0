"""What `AccumTrainer.tune()` does: build the probe's inputs from the trainer, probe or reuse, plan.

measure (probe.py, meters.py) -> plan (plan.py) -> train (trainer.apply_plan). Nothing here changes the
trainer; the plan is applied by `AccumTrainer.apply_plan` alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from . import _compat
from .loss import loss_shifts_labels
from .meters import CpuMeter, CudaMeter, Meter
from .plan import Plan
from .plan_store import load_plan, plan_key, save_plan
from .probe import ProbeResult, probe_model, random_token_batch, resolve_budget

logger = logging.getLogger(__name__)


def default_meter(model: torch.nn.Module) -> Meter:
    device = next(model.parameters()).device
    return CudaMeter(device) if device.type == "cuda" else CpuMeter()


def tune(trainer) -> tuple[Plan, ProbeResult | None, dict[str, Any]]:
    """Returns the plan, what the probe measured (None when the stored plan was reused) and the plan's key."""
    args = trainer.args
    _log_ignored_batch_settings(args)
    meter = default_meter(trainer.model)
    fraction = None if args.memory_budget_bytes is not None else args.memory_budget
    budget = resolve_budget(meter, args.memory_budget_bytes, fraction)
    make_batch, seq_len = probe_batches(trainer)
    device = str(meter.describe().get("device", meter.name))
    key = plan_key(trainer, seq_len=seq_len, budget_bytes=budget, capacity_bytes=meter.capacity_bytes(), device=device)
    plan = load_plan(args.output_dir, key)
    if plan is not None:
        logger.info("hf_accum: reusing the plan in %s (nothing that changes memory changed): %s",
                    args.output_dir, plan.describe())
        return plan, None, key

    _compat.enable_checkpointing(trainer.model, args)  # as train() will, so the probe measures it
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, trainer.model)
    autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    result, plan = probe_model(
        trainer.model,
        seq_len=seq_len,
        target_batch_size=args.target_batch_size,
        world_size=args.world_size,
        budget_bytes=budget,
        make_batch=make_batch,
        optimizer_cls=optimizer_cls,
        optimizer_kwargs=optimizer_kwargs,
        optimizer=trainer.optimizer,
        forward=lambda model, batch: trainer.compute_loss(model, batch),
        autocast_dtype=autocast,
        max_grad_norm=args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None,
        meter=meter,
        max_micro_batch=args.probe_max_micro_batch,
        optimize=args.auto_tune_optimize,
        log=logger.info,
    )
    logger.info("hf_accum: plan %s (largest micro-batch that fits: %d, budget %d bytes)",
                plan.describe(), result.max_micro_batch_size, budget)
    if args.should_save:
        save_plan(args.output_dir, key, plan, result.to_dict())
    return plan, result, key


def probe_batches(trainer) -> tuple[Callable[[int], dict[str, Any]], int]:
    """``make_batch(micro)`` at the worst-case length: the longest training example, collated ``micro`` times
    (or random tokens at ``probe_seq_len`` for causal LMs), and that length."""
    args = trainer.args
    if args.probe_seq_len is not None:
        if not loss_shifts_labels(trainer.model):
            raise ValueError(
                f"probe_seq_len={args.probe_seq_len} builds random causal-LM batches, but "
                f"{type(trainer.model).__name__} is not a causal LM. Leave probe_seq_len unset: the probe then "
                "measures with the longest training example."
            )
        return random_token_batch(trainer.model, args.probe_seq_len), args.probe_seq_len
    loader = trainer.get_train_dataloader()
    dataset, collate = loader.dataset, loader.collate_fn
    try:
        size = len(dataset)
    except TypeError:
        raise ValueError(
            "The training set is an iterable dataset, so its longest example is unknown; set probe_seq_len to the "
            "longest sequence length training will see."
        ) from None
    if size == 0:
        raise ValueError("train_dataset is empty: nothing to probe or train on.")
    longest = max(range(size), key=lambda i: _length(dataset[i]))
    example = dataset[longest]

    def make_batch(micro: int) -> dict[str, Any]:
        return _compat.prepare_inputs(trainer, collate([example] * micro))

    first = make_batch(1)
    seq_len = next((v.shape[1] for v in first.values() if torch.is_tensor(v) and v.dim() >= 2), 1)
    max_positions = getattr(getattr(trainer.model, "config", None), "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(
            f"The longest training example is {seq_len} tokens after collation, beyond the model's "
            f"max_position_embeddings={max_positions}. Truncate examples to at most {max_positions} tokens "
            "(e.g. tokenizer(..., truncation=True, max_length=...))."
        )
    return make_batch, int(seq_len)


def _length(example) -> int:
    if isinstance(example, dict):
        for key in ("input_ids", "inputs_embeds", "pixel_values"):
            if key in example:
                return len(example[key])
        return max((len(v) for v in example.values() if hasattr(v, "__len__") and not isinstance(v, str)), default=0)
    return len(example) if hasattr(example, "__len__") else 0


def _log_ignored_batch_settings(args) -> None:
    if args.per_device_train_batch_size != 8 or args.gradient_accumulation_steps != 1:
        logger.info(
            "hf_accum: auto_tune chooses the micro-batch and accumulation for target_batch_size=%d; ignoring "
            "per_device_train_batch_size=%d and gradient_accumulation_steps=%d.",
            args.target_batch_size, args.per_device_train_batch_size, args.gradient_accumulation_steps,
        )
