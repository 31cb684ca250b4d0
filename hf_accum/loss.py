"""Exact loss normalization over one accumulation window (all micro-batches, all data-parallel ranks).

The invariant, for mode ``"tokens"``: the loss of one optimizer step is

    L = (sum over ranks r, micro-batches m, counted labels t of loss_t) / N,
    N = number of counted labels in the whole window,

where a label is counted when it is not -100, after the causal shift when the model's loss shifts labels
(position 0 of a row is never a target then). Mode ``"samples"`` is the same with samples for labels:
the mean over the samples of the effective batch. The gradient of every optimizer step is the gradient of L,
and the logged training loss is L.

The mechanism does not depend on how the loss is computed (model forward with or without loss kwargs, a user
``compute_loss`` returning a micro-batch mean, ``compute_loss_func``, label smoothing): each of them is made
to return the mean over its own micro-batch's count ``n_m`` (by passing ``num_items_in_batch = n_m``, which
every transformers loss path and the documented ``compute_loss`` contract divide by). Multiplying that mean by
``n_m * W / N`` gives ``sum_m * W / N``; DDP/FSDP average gradients over the W ranks, so the step's gradient
is exactly that of L. The Trainer sums the per-micro-batch values and averages them over ranks when it logs,
which gives L again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

IGNORE_INDEX = -100
NORMALIZATIONS = ("tokens", "samples", "model")


def count_items(batch: Mapping, mode: str, shift: bool) -> torch.Tensor:
    """Number of counted labels (``"tokens"``) or samples (``"samples"``) in one collated micro-batch."""
    if mode == "samples":
        ref = batch.get("labels")
        if ref is None:
            ref = batch.get("input_ids")
        if ref is None:
            ref = next(v for v in batch.values() if torch.is_tensor(v))
        return torch.tensor(ref.shape[0], device=ref.device)
    if "shift_labels" in batch:  # padding-free collators give the shifted targets directly
        labels = batch["shift_labels"]
    else:
        labels = batch.get("labels")
        if labels is None:
            raise ValueError(
                "loss_normalization='tokens' needs a 'labels' tensor in every batch, but a batch has only "
                f"{sorted(batch.keys())}. Use a collator that sets labels (e.g. "
                "DataCollatorForLanguageModeling(tokenizer, mlm=False)), or set loss_normalization='samples' "
                "(one target per sample) or 'model'."
            )
        if shift:
            labels = labels[..., 1:]
    return labels.ne(IGNORE_INDEX).sum()


def loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss compares position i with label i+1 (causal LMs), found on the first
    `PreTrainedModel` inside ``model`` so that peft models and users' wrapper modules are seen through."""
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if inner is None:
        return False
    if getattr(inner.config, "is_encoder_decoder", False):
        return False
    if LOSS_MAPPING.get(getattr(inner, "loss_type", None)) is ForCausalLMLoss:
        return True
    return type(inner).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


@dataclass
class Window:
    """The accumulation window being trained: its global count and the data-parallel size W."""

    items: torch.Tensor  # N, summed over every micro-batch of the window on every rank
    world: int  # ranks whose gradients DDP/FSDP average

    def scale(self, local_items: torch.Tensor) -> torch.Tensor:
        """Factor turning a micro-batch mean over ``local_items`` into its exact share of the window loss."""
        # In float64 (MPS has none): integer tensors divide into float32, rounding the share at 1e-8 relative.
        dtype = torch.float32 if self.items.device.type == "mps" else torch.float64
        return local_items.to(self.items.device, dtype) * self.world / self.items.to(dtype)
