"""The rows the probe hands the user's collator: only batches training could hand it too.

The probe measures ``micro`` copies of the longest example. Batches of mixed lengths carry a padding mask, which
can cost more memory than their tokens (SDPA then builds the masked scores), so where the collator pads, the last
copy is one token shorter. Where it does not pad (`default_data_collator` and every stacking collator, padding-free
collators), the copies stay equal: a stacking collator cannot take rows of different lengths, and training never
hands it any. Whether a collator pads is known from its type, else found by collating two of the data's own rows of
different lengths (a batch training could build); data of one length never meets padding. A packed row
(`seq_lengths`, TRL's BFD packing) is shortened with its last packed sequence, so the row stays consistent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

Rows = Callable[[int], list]


def collator_name(collator) -> str:
    """How a message names the collator: its function's or its class's name."""
    return getattr(collator, "__qualname__", None) or type(collator).__name__


def known_to_pad(collator) -> bool | None:
    """Whether ``collator`` pads rows of different lengths, from its type: True for transformers' and TRL's padding
    collators, False for stacking ones (`default_data_collator`, torch's `default_collate`) and padding-free ones;
    None for a collator of unknown type (the data is collated to find out)."""
    from torch.utils.data import default_collate
    from transformers import data as hf_data

    if collator in (hf_data.default_data_collator, default_collate) or isinstance(
            collator, (hf_data.DefaultDataCollator, hf_data.DataCollatorWithFlattening)):
        return False
    if isinstance(collator, (hf_data.DataCollatorWithPadding, hf_data.DataCollatorForSeq2Seq,
                             hf_data.DataCollatorForLanguageModeling, hf_data.DataCollatorForTokenClassification)):
        return True
    trl_class = type(collator).__module__.split(".")[0] == "trl"
    if trl_class and type(collator).__name__ == "DataCollatorForLanguageModeling":
        return not collator.padding_free  # padding-free: one row of every sequence, no padding mask
    if trl_class and type(collator).__name__ == "DataCollatorForPreference":
        return True
    return None


def collate_pads(collate, pair: Sequence) -> bool:
    """Whether ``collate`` pads, found by collating ``pair``: two of the data's own rows of different lengths. A
    collator that cannot take them stacks equal rows; one that takes them pads where its batch has a padding mask
    with zeros (a padding-free collator takes them into one row and has none)."""
    try:
        batch = collate(list(pair))
    except Exception:  # the user's collator refuses rows of different lengths (any way it likes): it stacks
        return False
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    return torch.is_tensor(mask) and mask.dim() == 2 and not bool(mask.all())


def probe_rows(example, pads: bool) -> Rows:
    """``rows(micro)``: ``example`` ``micro`` times; where the collator ``pads``, the last copy one token shorter."""
    n = sequence_length(example)
    if not pads or not isinstance(example, dict) or n < 2:
        return lambda micro: [example] * micro
    shorter = trimmed(example, n)
    return lambda micro: [example] * (micro - 1) + [shorter] if micro > 1 else [example]


def trimmed(example: dict, n: int) -> dict:
    """``example`` one token shorter: each of its sequences of ``n`` items loses the last, and a packed row's last
    packed sequence (``seq_lengths``) loses it with them (dropped when it was one token long)."""
    out = {k: v[:-1] if k != "seq_lengths" and _is_seq(v) and len(v) == n else v for k, v in example.items()}
    if "seq_lengths" in example:
        lengths = [int(x) for x in example["seq_lengths"]]
        lengths[-1] -= 1
        out["seq_lengths"] = lengths if lengths[-1] else lengths[:-1]
    return out


def stretched(example: dict, n: int) -> dict:
    """``example`` with each of its sequences repeated out to ``n`` items (a packed row's last packed sequence grows
    with them): the longest example a bound of ``n`` tokens lets through, built from a real one."""
    width = sequence_length(example)
    out: dict[str, Any] = {}
    for key, value in example.items():
        if key == "seq_lengths" or not _is_seq(value) or len(value) == 0:
            out[key] = value
        elif torch.is_tensor(value):
            out[key] = value.repeat(math.ceil(n / len(value)))[:n]
        else:
            out[key] = (list(value) * math.ceil(n / len(value)))[:n]
    if "seq_lengths" in example:
        lengths = [int(x) for x in example["seq_lengths"]]
        lengths[-1] += n - width
        out["seq_lengths"] = lengths
    return out


def sequence_length(example) -> int:
    """An example's length: its input_ids (or inputs_embeds, pixel_values), else its longest 1-d sequence (a
    0-d tensor, a number or a string is no sequence)."""
    if isinstance(example, dict):
        for key in ("input_ids", "inputs_embeds", "pixel_values"):
            if key in example:
                return len(example[key])
        return max((len(v) for v in example.values() if _is_seq(v)), default=0)
    return len(example) if _is_seq(example) else 0


def _is_seq(value) -> bool:
    if hasattr(value, "shape"):
        return len(value.shape) >= 1
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))
