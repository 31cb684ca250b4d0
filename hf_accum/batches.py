"""Cutting a collated batch into smaller micro-batches (the accumulation check and OOM recovery use it).

A chunk keeps only the columns some row of it still needs (right padding), so it is the tensor a collator
padding to the longest example would have built for those samples: the same shapes, the same arithmetic.
"""

from __future__ import annotations

import torch

from .loss import IGNORE_INDEX


def batch_size(batch) -> int:
    return next(v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)


def split(batch, chunk: int) -> list[dict]:
    """Consecutive chunks of at most ``chunk`` samples, each trimmed to its own padded length."""
    size = batch_size(batch)
    if chunk >= size:
        return [batch]
    return [trim_padding(_rows(batch, lo, min(lo + chunk, size), size)) for lo in range(0, size, chunk)]


def split_even(batch, k: int) -> list[dict]:
    """``k`` chunks of near-equal size, each trimmed to its own padded length."""
    size = batch_size(batch)
    bounds = [round(i * size / k) for i in range(k + 1)]
    return [trim_padding(_rows(batch, lo, hi, size)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _rows(batch, lo: int, hi: int, size: int) -> dict:
    return {k: v[lo:hi] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == size else v for k, v in batch.items()}


def trim_padding(batch: dict) -> dict:
    """Cut trailing columns that are padding in every row: attention 0 and label -100 everywhere."""
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return batch
    labels = batch.get("labels")
    keep = mask.bool().any(0)
    if labels is not None and labels.dim() == 2 and labels.shape == mask.shape:
        keep = keep | labels.ne(IGNORE_INDEX).any(0)
    nz = keep.nonzero()
    length = int(nz.max()) + 1 if len(nz) else mask.shape[1]
    seq = mask.shape[1]
    return {k: v[:, :length] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == seq else v for k, v in batch.items()}


def sliver(batch: dict) -> dict:
    """One sample, two positions: the smallest forward that still touches every parameter."""
    return {
        k: (v[:1, :2] if v.dim() >= 2 else v[:1]) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()
    }
