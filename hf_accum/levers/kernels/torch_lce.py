"""torch's own ``torch.nn.functional.linear_cross_entropy`` with ``LinearCrossEntropyOptions`` (torch >= 2.13): row
chunks whose gradients are computed inside the forward, so the backward only hands them on.

It returns its loss in the input dtype, so on bf16/fp16 weights (or under autocast) it would round the token-loss
sum, and hf_accum's window scale applied to it, to that dtype: it runs for float32/float64 only, where ours keeps
float32. Its chunked path computes no label smoothing (torch falls back to the full logits, with a warning that is
made an error here).
"""

from __future__ import annotations

import torch

from ...compat import torch_features
from .base import Memory
from .chunked import rows_for

NAME = "torch"
COUNTED_BY_OPS = False
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


def loss_sum(hidden, weight, bias, targets, *, label_smoothing: float = 0.0, rows: int | None = None):
    return torch_features.linear_cross_entropy_sum(hidden, weight, bias, targets,
                                                   rows or rows_for(hidden.device.type, weight.shape[0]))


def memory(rows: int, hidden: int, vocab: int, itemsize: int, device_type: str = "cpu",
           weight_grad: bool = True) -> Memory:
    """Held from the forward to the backward: the gradients it computed there, of the hidden states (rows x hidden)
    and of the weight (vocab x hidden). Inside the forward: one chunk's logits, turned into their gradient in place.
    The backward only scales them into its outputs. Measured on the CPU (torch 2.13, vocab 32000, hidden 128,
    float32, 255 / 1024 / 2805 rows): forward 47.1 / 79.4 / 81.2 MiB, this model 47.0 / 78.7 / 79.6."""
    c = min(rows, rows_for(device_type, vocab))
    held = (rows * hidden + (vocab * hidden if weight_grad else 0)) * itemsize
    return Memory(held=held, forward=c * vocab * max(itemsize, 4), backward=0, grads_in_forward=True)
