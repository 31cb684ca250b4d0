"""The one place that knows how transformers' `Trainer.training_step` post-processes the loss.

`training_step` divides the value returned by `compute_loss` by the number of micro-batches in the window
unless it believes the loss is already normalized for accumulation. The rule changed between versions:
- transformers 5.17: divides iff `(not model_accepts_loss_kwargs or num_items_in_batch is None)
  and compute_loss_func is None`;
- transformers >= 5.2x: a class attribute `loss_is_scaled_for_ga` overrides that rule when not None.
`tests/test_compat.py` fails when a new version changes this, and `AccumTrainer` checks the returned value
of its first training step against this prediction at run time.
"""

from __future__ import annotations

import torch
from transformers import Trainer

# Older versions ignore the attribute even when a subclass sets it.
HAS_LOSS_IS_SCALED_FOR_GA = hasattr(Trainer, "loss_is_scaled_for_ga")


def trainer_divides_by_accumulation(trainer, num_items_in_batch) -> bool:
    declared = getattr(trainer, "loss_is_scaled_for_ga", None) if HAS_LOSS_IS_SCALED_FOR_GA else None
    if declared is not None:
        return not declared
    scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
        trainer.compute_loss_func is not None
    )
    return not scaled


def checkpointing_enabled(args) -> bool:
    """Gradient checkpointing asked for, under either name (5.23 renamed it "activation checkpointing")."""
    flag = getattr(args, "activation_checkpointing", None)
    return bool(flag if flag is not None else args.gradient_checkpointing)


def enable_checkpointing(model, args) -> None:
    """Turn on gradient checkpointing as `Trainer.train()` will, so a probe that runs before `train()` measures
    the memory training will use. Idempotent."""
    if not checkpointing_enabled(args):
        return
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
    kwargs = {k: v for k, v in kwargs.items() if k not in ("every_n_layers", "offload")}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)



# --- torch's chunked linear + cross-entropy (fused_loss.py) -------------------------------------------------------
# torch 2.13 added `F.linear_cross_entropy(..., options=LinearCrossEntropyOptions(...))`: a chunked path that never
# builds the (rows, vocab) logits and computes the gradients inside the forward. Older torch (the supported range
# starts at 2.6) has neither; fused_loss.py then uses its own checkpointed chunks.
HAS_LINEAR_CROSS_ENTROPY = hasattr(torch.nn.functional, "linear_cross_entropy") and hasattr(
    torch.nn, "LinearCrossEntropyOptions"
)


def linear_cross_entropy_sum(hidden, weight, bias, targets, rows: int):
    """Sum over rows of cross_entropy(hidden @ weight.T + bias, targets) on torch's chunked path, ``rows`` rows per
    chunk. Raises instead of silently building the full logits when torch declines the chunked path."""
    import warnings

    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=rows, chunking_method=None)
    with warnings.catch_warnings():
        # torch warns and falls back to the full-logits reference when it cannot chunk: that would be the memory
        # this path exists to avoid, so make it an error (it means torch changed what it supports).
        warnings.filterwarnings("error", message=".*options.*ignored", category=UserWarning)
        return torch.nn.functional.linear_cross_entropy(
            hidden, weight, targets, linear_bias=bias, reduction="sum", ignore_index=-100, options=options
        )


def is_autocast_enabled(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type)


def deepspeed_zero3_enabled() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


# --- TRL (trl.py) -----------------------------------------------------------------------------------------------
def trl_fuses_lm_head() -> bool:
    """Whether TRL's SFTTrainer computes its loss through `add_fused_lm_head` (a patched `model.forward` called with
    `fused_lm_head=True`, TRL >= 1.x) rather than from the model's logits."""
    try:
        from trl.trainer import utils
    except ImportError:
        return False
    return hasattr(utils, "add_fused_lm_head")
