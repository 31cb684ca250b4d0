"""Apple's Cut Cross-Entropy (``cut-cross-entropy``, ``linear_cross_entropy(..., impl="cce")``): Triton, CUDA only
here (its ``impl="torch_compile"`` path off CUDA is not registered). It never builds the logits, not even a chunk's:
its memory is the gradients of its inputs in the backward and a few float32 values per row.
"""

from __future__ import annotations

import torch

from .base import Memory, triton_package_missing

NAME = "cut_ce"
COUNTED_BY_OPS = False
PACKAGE = "cut-cross-entropy"
SETTINGS = ()


def unavailable(device_type: str, dtype: torch.dtype, autocast: bool = False) -> str | None:
    return triton_package_missing(PACKAGE, "cut_cross_entropy", device_type)


def loss_sum(hidden, weight, bias, targets, *, label_smoothing: float = 0.0):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=-100, reduction="sum",
                                impl="cce").float()


def memory(rows: int, hidden: int, vocab: int, itemsize: int, device_type: str = "cuda",
           weight_grad: bool = True) -> Memory:
    """Held: the log-sum-exp per row (float32). Backward: the gradients of the hidden states and the weight."""
    grads = (rows * hidden + (vocab * hidden if weight_grad else 0)) * itemsize
    return Memory(held=rows * 4, forward=rows * 8, backward=grads)
