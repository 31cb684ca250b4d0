"""torch features hf_accum uses where present: the profiler's events, the attention implementation, the chunked
linear + cross-entropy (fused_loss.py) and autocast. Pinned by tests/compat/test_compat.py and tests/levers/test_fused_loss.py.
"""

from __future__ import annotations

import torch


def kineto_events(prof):
    """The finished profiler's raw kineto events (the `[memory]` events the CPU meter replays)."""
    return prof.profiler.kineto_results.events()


def attn_implementation(model) -> str | None:
    """The attention kernel the model runs (eager, sdpa, flash_attention_2, ...): it changes a step's memory.
    transformers keeps it in the config's private `_attn_implementation` (5.17 to 5.23)."""
    config = getattr(model, "config", None)
    value = getattr(config, "_attn_implementation", None) if config is not None else None
    return None if value is None else str(value)


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
