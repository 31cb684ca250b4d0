"""Liger's fused linear cross-entropy (``liger-kernel``): Triton, CUDA only. Registered so that its rule and its
memory model are seen everywhere; it runs where the package and a CUDA device are there (not measured on CPU).

Liger computes the gradients in its forward, chunk by chunk in the weights' dtype, and sums the loss in float32."""

from __future__ import annotations

import torch

from .base import Memory, package_missing, triton_package_missing

NAME = "liger"
COUNTED_BY_OPS = False
PACKAGE = "liger-kernel"
SETTINGS = ("label_smoothing",)


def unavailable(device_type: str, dtype: torch.dtype, autocast: bool = False) -> str | None:
    return triton_package_missing(PACKAGE, "liger_kernel", device_type)


def refuse_missing_package() -> None:
    """``use_liger_kernel=True`` without liger-kernel: one line now (AccumTrainingArguments), not transformers'
    ImportError after the probe."""
    if package_missing(PACKAGE, "liger_kernel"):
        raise ValueError("use_liger_kernel=True needs liger-kernel, which is not installed: pip install liger-kernel "
                         "(or set use_liger_kernel=False: hf_accum's fused loss is on without it)")


def loss_sum(hidden, weight, bias, targets, *, label_smoothing: float = 0.0):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=-100,
                                            label_smoothing=label_smoothing, reduction="sum").float()


def memory(rows: int, hidden: int, vocab: int, itemsize: int, device_type: str = "cuda",
           weight_grad: bool = True) -> Memory:
    """Held: the gradients computed in the forward (hidden states, and the weight's in its dtype). Transient: one
    chunk's logits (Liger sizes chunks as about rows / ceil(vocab / hidden) rows, a power of two) in float32."""
    chunk = max(1, rows // max(1, -(-vocab // hidden)))
    chunk = 1 << (chunk.bit_length() - 1)
    held = (rows * hidden + (vocab * hidden if weight_grad else 0)) * itemsize
    return Memory(held=held, forward=chunk * vocab * (itemsize + 4), backward=0, grads_in_forward=True)
