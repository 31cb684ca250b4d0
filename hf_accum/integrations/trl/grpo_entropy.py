"""GRPO's entropy terms over the whole generation batch (grpo.py's window and forwards use them).

TRL's `_compute_loss` has two terms that are statistics of each forward, so their loss depends on the cut:
the entropy filter (`top_entropy_quantile` < 1: only the completion tokens whose entropy is at least a quantile of
the forward's) and the static entropy bonus (`entropy_coef` x the token mean of the forward's entropies). hf_accum
defines both over the whole generation batch, which is TRL's own when the generation batch is one forward, and
exact under any cut: the filter's mask is computed once per optimizer step over the window, and each forward's
bonus coefficient is rescaled to its share of the window's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...compat import trl_internals


def loss_mask(batch: Mapping) -> torch.Tensor:
    """TRL's loss mask of a GRPO batch: completion tokens, less tool outputs where tools ran."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


ENTROPY_MASK = "hf_accum_entropy_mask"  # the window's entropy filter, per completion token (with_entropy_masks)


def with_entropy_masks(trainer, slices: list[dict], rows: int | None) -> list[dict]:
    """top_entropy_quantile < 1: TRL trains only on the completion tokens whose entropy is at least a quantile of
    the entropies of its forward (over every rank), so its loss depends on the cut. hf_accum takes the quantile
    over the whole generation batch once per optimizer step: a no-gradient forward over the window (``rows`` per
    chunk) at the step's weights, TRL's own `get_high_entropy_mask` on all of its tokens, and each slice carries its
    rows of the mask to the forwards that train on them. Exact under any cut (the mask does not depend on it); the
    cost is one more no-gradient forward per step."""
    if any("pixel_values" in s for s in slices):
        raise ValueError("top_entropy_quantile < 1 with images: hf_accum's window-wide entropy filter does not forward "
                         "images. Set top_entropy_quantile=1.0, or loss_normalization='model'.")
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask")
    batch = {k: torch.cat([s[k] for s in slices]) for k in keys if k in slices[0]}
    entropies = trl_internals.grpo_entropies(trainer, batch, rows or len(batch["completion_ids"]))
    keep = trainer.get_high_entropy_mask(entropies, loss_mask(batch), 1 - trainer.args.top_entropy_quantile)
    out, start = [], 0
    for s in slices:
        n = len(s["completion_ids"])
        out.append({**s, ENTROPY_MASK: keep[start:start + n]})
        start += n
    return out


def bonus_mask(batch: Mapping) -> torch.Tensor:
    """The tokens TRL's entropy bonus averages over: the loss mask, less the entropy filter's tokens."""
    mask = loss_mask(batch)
    return mask * batch[ENTROPY_MASK] if ENTROPY_MASK in batch else mask


def entropy_bonus_factor(forward_tokens, window_tokens, share, world: int) -> float:
    """What one forward's entropy coefficient is multiplied by so that the bonus is a token mean over the window.

    TRL subtracts coef x (the forward's entropy sum / its ``forward_tokens``); the mixin scales the forward's loss
    by ``share`` (its count over the window's, x ``world``: DDP averages over ranks). The window's bonus is coef x
    entropy sum / ``window_tokens`` (every rank's), so each forward's coefficient is multiplied by
    forward_tokens x world / (window_tokens x share): 1 when the loss is itself a token mean (dapo)."""
    return float(forward_tokens * world / (window_tokens * share))
