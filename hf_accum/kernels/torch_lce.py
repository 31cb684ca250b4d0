"""torch's own ``torch.nn.functional.linear_cross_entropy`` with ``LinearCrossEntropyOptions`` (torch >= 2.13): row
chunks whose gradients are computed inside the forward, so the backward only hands them on.

It returns its loss in the input dtype, so on bf16/fp16 weights (or under autocast) it would round the token-loss
sum, and hf_accum's window scale applied to it, to that dtype: it runs for float32/float64 only, where ours keeps
float32. Its chunked path computes no label smoothing (torch falls back to the full logits, with a warning that is
made an error here).
"""

from __future__ import annotations

import torch

from ..compat import torch_features
from .base import Memory
from .chunked import rows_for

NAME = "torch"
PACKAGE = None
SETTINGS = ()


def unavailable(device_type: str, dtype: torch.dtype, autocast: bool = False) -> str | None:
    if not torch_features.HAS_LINEAR_CROSS_ENTROPY:
        return f"torch {torch.__version__} has no linear_cross_entropy (torch >= 2.13)"
    if autocast:
        return "under autocast it would return the loss in the autocast dtype"
    if dtype not in (torch.float32, torch.float64):
        return f"it returns the loss in the input dtype ({dtype}), which rounds the token-loss sum"
    return None


def loss_sum(hidden, weight, bias, targets, *, label_smoothing: float = 0.0):
    return torch_features.linear_cross_entropy_sum(hidden, weight, bias, targets,
                                                   rows_for(hidden.device.type, weight.shape[0]))


def memory(rows: int, hidden: int, vocab: int, itemsize: int, device_type: str = "cpu") -> Memory:
    """Held from the forward to the backward: the gradients it computed there, of the hidden states (rows x hidden)
    and of the weight (vocab x hidden, and the bias's). Inside the forward: one chunk's logits and their gradient
    (float32 accumulation) plus the weight gradient being summed."""
    c = min(rows, rows_for(device_type, vocab))
    held = (rows * hidden + vocab * hidden + vocab) * itemsize
    forward = c * vocab * (2 * itemsize + 4) + vocab * hidden * itemsize
    return Memory(held=held, forward=forward, backward=0)
