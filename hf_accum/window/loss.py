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


@dataclass(frozen=True)
class LabelSpec:
    """Which labels of a batch count: the key (``args.label_names[0]``, else ``labels``), the ignore index the
    model's loss skips, and whether that loss compares position i with label i+1 (causal LMs)."""

    key: str = "labels"
    ignore_index: int = IGNORE_INDEX
    shift: bool = False

    def count(self, batch: Mapping) -> torch.Tensor:
        """Counted labels of one batch (``"tokens"`` mode)."""
        if "shift_labels" in batch:  # padding-free collators give the shifted targets directly
            labels = batch["shift_labels"]
        else:
            labels = batch.get(self.key)
            if labels is None:
                raise ValueError(
                    f"loss_normalization='tokens' needs a {self.key!r} tensor in every batch, but a batch has only "
                    f"{sorted(batch.keys())}. Use a collator that sets labels (e.g. "
                    "DataCollatorForLanguageModeling(tokenizer, mlm=False) for language modelling), set label_names "
                    "to the key that holds them, or set loss_normalization='samples' (one target per sample)."
                )
            if self.shift:
                labels = labels[..., 1:]
        return labels.ne(self.ignore_index).sum()


# Models whose own loss skips another label value than -100, read from a named config field, and divides by the
# number of labels it kept (so hf_accum can drive it exactly once it counts the same labels). Allow-list: a new
# entry needs a test against an independent reference (tests/window/test_labels.py).
_IGNORE_INDEX_FIELDS = {
    "segformer": "semantic_loss_ignore_index",
}


def label_spec(model: nn.Module, label_names: list[str] | None, *, custom_loss: bool) -> LabelSpec:
    """The `LabelSpec` for ``model``; refuses a model whose own loss skips labels hf_accum does not know.

    ``custom_loss``: the loss comes from a `compute_loss` override or `compute_loss_func` (their contract is
    the documented one: -100 skipped, divide by ``num_items_in_batch``), not from the model."""
    from transformers import PreTrainedModel

    key = label_names[0] if label_names else "labels"
    shift = loss_shifts_labels(model)
    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    config = getattr(inner, "config", None)
    if config is None or custom_loss:
        return LabelSpec(key, IGNORE_INDEX, shift)
    known = _IGNORE_INDEX_FIELDS.get(getattr(config, "model_type", None))
    if known is not None and getattr(config, "num_labels", 2) > 1:
        return LabelSpec(key, int(getattr(config, known)), shift)
    for name, value in sorted(config.to_dict().items()):
        if "ignore_index" in name and isinstance(value, int) and value != IGNORE_INDEX:
            raise ValueError(
                f"{type(inner).__name__} computes its loss skipping label {value} (config.{name}), which hf_accum "
                "cannot count exactly for this model. Set loss_normalization='model' (transformers' own, inexact "
                f"accumulation), or pass compute_loss_func that skips -100 and divides by num_items_in_batch "
                f"(and use -100 for the labels to skip)."
            )
    return LabelSpec(key, IGNORE_INDEX, shift)


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
