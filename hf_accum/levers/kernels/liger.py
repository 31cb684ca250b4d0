"""Liger's fused linear cross-entropy (``liger-kernel``): Triton, CUDA only. Registered so that its rule and its
memory model are seen everywhere; it runs where the package and a CUDA device are there (not measured on CPU).

Liger computes the gradients in its forward, chunk by chunk in the weights' dtype, and sums the loss in float32.

``use_liger_kernel=True`` ends in one loss path (`route`): transformers' Trainer patches the model with Liger's
kernels when training starts, and Liger's own fused linear cross-entropy replaces the model's ``forward`` (its loss
normalized by each forward's own count, beside hf_accum's fused-loss patch). So that patch is turned off
(``liger_kernel_config["fused_linear_cross_entropy"] = False``; its other kernels -- RMSNorm, RoPE, SwiGLU -- stay
on) and hf_accum's fused loss runs Liger's kernel instead (the ``loss_kernel`` lever pins ``liger``), normalized by
the window's count; with ``fused_loss=False`` the loss is the model's own, from its full logits. TRL's SFTTrainer
turns Liger's patch off itself and computes its loss in its own fused LM head."""

from __future__ import annotations

import torch

from ...config.settings import Settings
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

    loss = liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=-100,
                                            label_smoothing=label_smoothing, reduction="sum")
    return loss if loss.dtype == torch.float64 else loss.float()  # the seam's contract (base.py)


def memory(rows: int, hidden: int, vocab: int, itemsize: int, device_type: str = "cuda",
           weight_grad: bool = True) -> Memory:
    """Held: the gradients computed in the forward (hidden states, and the weight's in its dtype). Transient: one
    chunk's logits (Liger sizes chunks as about rows / ceil(vocab / hidden) rows, a power of two) in float32."""
    chunk = max(1, rows // max(1, -(-vocab // hidden)))
    chunk = 1 << (chunk.bit_length() - 1)
    held = (rows * hidden + (vocab * hidden if weight_grad else 0)) * itemsize
    return Memory(held=held, forward=chunk * vocab * (itemsize + 4), backward=0, grads_in_forward=True)


def route(config: dict | None, fused_loss: bool | None, device_type: str) -> tuple[dict, str | None]:
    """``use_liger_kernel=True`` as one loss path: the ``liger_kernel_config`` transformers applies (Liger's
    fused linear cross-entropy off, its other kernels as given) and the loss kernel hf_accum's fused loss runs
    (None with ``fused_loss=False``). ValueError, one line naming the setting, for what cannot run that way: a CPU
    (or other non-CUDA) run -- Liger's kernels are Triton, CUDA only -- and an explicit
    ``fused_linear_cross_entropy=True``, which would replace the forward hf_accum's fused loss patches."""
    if device_type != "cuda":
        raise ValueError(f"use_liger_kernel=True: Liger's kernels are Triton kernels for CUDA only, and this run is on "
                         f"{device_type}; set use_liger_kernel=False (hf_accum's fused loss is on without it)")
    config = dict(config or {})
    if config.get("fused_linear_cross_entropy"):
        raise ValueError("liger_kernel_config={'fused_linear_cross_entropy': True} replaces the model's forward, "
                         "where hf_accum's fused loss runs (Liger's kernel itself, normalized by the window's count): "
                         "drop that key (use_liger_kernel=True keeps Liger's other kernels)")
    config["fused_linear_cross_entropy"] = False
    return config, None if fused_loss is False else NAME


def configure(args, device_type: str) -> None:
    """``use_liger_kernel=True`` on ``args``: refused without the package or off CUDA (one line, before any model
    work), otherwise its ``liger_kernel_config`` made `route`'s (the pin is `kernels.lever.requested`'s)."""
    refuse_missing_package()
    args.liger_kernel_config, _ = route(args.liger_kernel_config, Settings(args).fused_loss, device_type)
