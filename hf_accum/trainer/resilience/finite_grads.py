"""Whether a window's gradients (and, when training stops, the weights) are finite: a step can have a finite loss and non-finite gradients (fp16 weights
with a large learning rate overflow in backward), and stepping on them leaves NaN weights.

Checked once per optimizer step, on the device, combined with the window loss's check into the one host sync the
window already makes (window/engine.py `_done`). The max-abs (inf-)norm is used, not the 2-norm clipping computes: it is
infinite or NaN exactly when some element is, where a 2-norm of finite fp16 gradients can overflow."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def all_finite(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """A device bool tensor: every element of every tensor is finite (None: no tensor). Sharded (DTensor) tensors
    are checked on this rank's shard; for gradients the ranks then agree to skip if any rank saw a non-finite one."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    if not local:
        return None
    return torch.isfinite(torch.nn.utils.get_total_norm([t.detach() for t in local], norm_type=math.inf))


def gradients_finite(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    return all_finite(p.grad for p in parameters if p.grad is not None)


def weights_finite(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """Whether this rank's weights are all finite (a host sync: asked once, when training stops)."""
    finite = all_finite(parameters)
    return finite is None or bool(finite)
