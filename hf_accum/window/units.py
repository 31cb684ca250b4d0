"""What one unit of a collated batch is, and how a batch is cut into chunks of whole units.

Exact accumulation lets a window be cut into forwards any way memory needs (OOM recovery, the accumulation
check, token budgets), but only along the batch's real units:

- ``rows``: padded rows, one sample each (every tensor whose dim 0 is the row count is cut with them);
- ``sequences``: padding-free rows (``DataCollatorWithFlattening``, TRL ``padding_free`` / ``packing``): one
  ``[1, T]`` row holding several sequences. Cut at sequence starts (``cu_seq_lens_q`` when present, otherwise
  wherever ``position_ids`` does not continue by +1 -- the start value is model-specific); per-token tensors
  are cut, and ``cu_seq_lens_*``, ``max_length_*`` and ``seq_idx`` are rebuilt for each chunk;
- ``pairs``: preference batches as TRL collates them, ``[chosen_0..chosen_{B-1}; rejected_0..rejected_{B-1}]``:
  pair i is row i with row B+i, and tensors of B rows (``ref_chosen_logps`` ...) go with their pair.

Anything else (a tensor whose first dimension is none of these, several packed rows) is ``indivisible``: a cut
raises `IndivisibleBatch` instead of guessing. Every cut is checked: the chunks' counted labels must add up to
the batch's (`cut_exactly`), so a cut that would change the loss is refused, never trained.

A chunk is trimmed to its own padding only where that cannot change the loss: right padding (attention 0)
whose per-token labels are all ignored. Sample-level losses (classification, extractive QA, whose span softmax
runs over every position) keep the batch's width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .loss import LabelSpec

UNITS = ("rows", "sequences", "pairs")
UNIT_NAME = {"rows": "sample", "sequences": "sequence", "pairs": "pair"}  # one unit, in messages
_FLAT_DERIVED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class IndivisibleBatch(ValueError):
    """The batch cannot be cut into smaller forwards without changing what is computed."""


@dataclass(frozen=True)
class Cutter:
    """Cuts batches of one unit kind. ``labels`` says which labels count (key, ignore index, causal shift)."""

    unit: str
    labels: LabelSpec

    def units(self, batch: Mapping) -> int:
        """How many units (samples, sequences or pairs) the batch holds."""
        return _UNIT_COUNT[self.unit](batch)

    def count(self, batch: Mapping, mode: str) -> torch.Tensor:
        """Counted labels (``"tokens"``) or units (``"samples"``) of one batch, as a tensor on its device."""
        if mode == "samples":
            return torch.tensor(self.units(batch), device=_device(batch))
        return self.labels.count(batch)

    def cut(self, batch: Mapping, max_units: int, mode: str | None = None, trim: bool = True) -> list[dict]:
        """Consecutive chunks of at most ``max_units`` units, each trimmed where trimming is exact (unless ``trim``
        is False: evaluation keeps the batch's width, so the logits it gathers keep their shape). With ``mode``
        the cut is verified (`verified`)."""
        total = self.units(batch)
        chunks = self._chunks(batch, list(range(0, total, max_units)) + [total], trim)
        return self.verified(batch, chunks, mode) if mode else chunks

    def cut_at(self, batch: Mapping, unit: int) -> list[dict]:
        """Two untrimmed chunks, units ``[0, unit)`` and ``[unit, end)`` (``0 < unit < units``)."""
        return self._chunks(batch, [0, unit, self.units(batch)], trim=False)

    def cut_even(self, batch: Mapping, k: int, mode: str | None = None, trim: bool = True) -> list[dict]:
        """``k`` chunks of near-equal unit counts (verified with ``mode``; trimmed as `cut` says)."""
        total = self.units(batch)
        k = max(1, min(k, total))
        chunks = self._chunks(batch, [round(i * total / k) for i in range(k + 1)], trim)
        return self.verified(batch, chunks, mode) if mode else chunks

    def cut_near_equal(self, batch: Mapping, max_units: int, groups: int | None = None,
                       mode: str | None = None) -> list[dict]:
        """``ceil(units / max_units)`` forwards (at least ``groups``: equal counts on ranks) whose unit counts
        differ by at most one. Padded rows and pairs go longest first, so the longest rows share a forward (less
        padding) and get the smaller counts; padding-free sequences keep their order. Verified with ``mode``."""
        from .cuts import forwards_for, near_equal_groups, near_equal_sizes

        total = self.units(batch)
        sizes = near_equal_sizes(total, max(forwards_for(total, max_units), groups or 1))
        if len(sizes) == 1:
            return [dict(batch)]
        if self.unit == "sequences":
            chunks = self._chunks(batch, [sum(sizes[:i]) for i in range(len(sizes) + 1)])
        else:
            take = _take_pair_indices if self.unit == "pairs" else _take_row_indices
            chunks = [self._trim(take(batch, idx)) for idx in near_equal_groups(self.lengths(batch), max_units, groups)]
        return self.verified(batch, chunks, mode) if mode else chunks

    def cut_by_tokens(self, batch: Mapping, budget: int, groups: int | None = None,
                      mode: str | None = None) -> list[dict]:
        """Chunks under ``budget`` tokens per forward (see token_budget.py): padded rows sorted by length, the
        fewest forwards, then the least padding; at least ``groups`` chunks when given (equal counts on ranks)."""
        from .token_budget import partition_packed, partition_padded

        if self.unit == "sequences":
            bounds = _boundaries(batch)
            spans = partition_packed([b - a for a, b in zip(bounds[:-1], bounds[1:])], budget, groups)
            chunks = [_take_sequences(batch, lo, hi) for lo, hi in spans]
        else:
            lengths = self.lengths(batch)
            take = _take_pair_indices if self.unit == "pairs" else _take_row_indices
            chunks = [self._trim(take(batch, idx)) for idx in partition_padded(lengths, budget, groups)]
        return self.verified(batch, chunks, mode) if mode else chunks

    def forwards_under(self, batch: Mapping, budget: int) -> int:
        """How many forwards `cut_by_tokens` makes unless the ranks agreed on more."""
        from .token_budget import partition_packed, partition_padded

        if self.unit == "sequences":
            bounds = _boundaries(batch)
            return len(partition_packed([b - a for a, b in zip(bounds[:-1], bounds[1:])], budget))
        return len(partition_padded(self.lengths(batch), budget))

    def lengths(self, batch: Mapping) -> list[int]:
        """Tokens each unit needs (its row up to its last attended or counted position; a pair: its longer row)."""
        mask = batch.get("attention_mask")
        ids = next((v for v in batch.values() if torch.is_tensor(v) and v.dim() == 2), None)
        if ids is None:  # rows of single numbers (a regression's x and y): one position each
            rows = next(v for v in batch.values() if torch.is_tensor(v) and v.dim() >= 1)
            per_row = [1] * int(rows.shape[0])
        elif not torch.is_tensor(mask) or mask.dim() != 2:
            per_row = [int(ids.shape[1])] * int(ids.shape[0])
        else:
            keep = mask.bool()
            labels = batch.get(self.labels.key)
            if torch.is_tensor(labels) and labels.shape == mask.shape:
                keep = keep | labels.ne(self.labels.ignore_index)
            positions = torch.arange(1, mask.shape[1] + 1, device=mask.device).expand_as(keep)
            per_row = (positions * keep).amax(1).tolist()
        if self.unit == "pairs":
            half = len(per_row) // 2
            return [max(a, b) for a, b in zip(per_row[:half], per_row[half:])]
        return [int(x) for x in per_row]

    def verified(self, batch: Mapping, chunks: list[dict], mode: str) -> list[dict]:
        """``chunks``, refused when their counts do not add up to the batch's (the cut would change the loss)."""
        if len(chunks) > 1:
            whole = int(self.count(batch, mode))
            parts = sum(int(self.count(c, mode)) for c in chunks)
            if whole != parts:
                raise IndivisibleBatch(
                    f"cutting this {self.unit} batch into {len(chunks)} forwards changes its counted labels "
                    f"({whole} -> {parts}): some label crosses a cut (e.g. a packed sequence whose first label is "
                    "not -100). Mask the first label of every packed sequence, as DataCollatorWithFlattening does."
                )
        return chunks

    def _chunks(self, batch: Mapping, bounds: list[int], trim: bool = True) -> list[dict]:
        if len(bounds) <= 2:
            return [dict(batch)]
        take = _TAKE[self.unit]
        chunks = [take(batch, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]
        return [self._trim(c) for c in chunks] if trim else chunks

    def _trim(self, chunk: dict) -> dict:
        if self.unit == "sequences":
            return chunk
        return trim_padding(chunk, self.labels)


def detect_unit(batch: Mapping) -> str:
    """``rows`` or ``sequences`` from the batch's own keys; ``pairs`` cannot be told apart from rows by shape,
    so trainers for preference data declare it (`AccumulationMixin.batch_unit`)."""
    if "cu_seq_lens_q" in batch:
        return "sequences"
    pos = batch.get("position_ids")
    if torch.is_tensor(pos) and pos.dim() == 2 and pos.shape[1] > 1 and "attention_mask" not in batch:
        if bool(_sequence_starts(pos[0]).numel() > 1):
            return "sequences"
    return "rows"


def make_cutter(unit: str, labels: LabelSpec) -> Cutter:
    if unit not in UNITS:
        raise ValueError(f"unknown batch unit {unit!r}; expected one of {list(UNITS)}")
    return Cutter(unit, labels)


# --- rows -----------------------------------------------------------------------------------------------------
def _rows(batch: Mapping) -> int:
    for v in batch.values():
        if torch.is_tensor(v) and v.dim() > 0:
            return int(v.shape[0])
    raise IndivisibleBatch("the batch holds no tensor with a batch dimension")


def _take_rows(batch: Mapping, lo: int, hi: int) -> dict:
    return _select_rows(batch, slice(lo, hi))


def _take_row_indices(batch: Mapping, idx: list[int]) -> dict:
    return _select_rows(batch, idx)


def _select_rows(batch: Mapping, pick: slice | list[int]) -> dict:
    """Rows ``pick`` (a slice: views; an index list: copies) of every tensor and list that has one entry per row."""
    size = _rows(batch)
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v) and v.dim() > 0:
            if v.shape[0] != size:
                raise IndivisibleBatch(
                    f"batch key {k!r} has {v.shape[0]} entries along dim 0 but the batch has {size} rows, so it is "
                    "not cut with the rows; hf_accum does not know how to cut it. Declare the trainer's batch_unit "
                    "('pairs' for chosen/rejected batches) or keep micro-batches uncut (probe_max_micro_batch=1)."
                )
            out[k] = v[pick] if isinstance(pick, slice) else v.index_select(0, torch.tensor(pick, device=v.device))
        elif isinstance(v, list | tuple) and len(v) == size:
            out[k] = v[pick] if isinstance(pick, slice) else [v[i] for i in pick]
        else:
            out[k] = v
    return out


def _take_pair_indices(batch: Mapping, idx: list[int]) -> dict:
    half = _pairs(batch)
    per_pair = {k for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == half}
    out = _take_row_indices({k: v for k, v in batch.items() if k not in per_pair}, idx + [half + i for i in idx])
    for k in per_pair:
        out[k] = batch[k].index_select(0, torch.tensor(idx, device=batch[k].device))
    return out


# --- pairs ----------------------------------------------------------------------------------------------------
def _pairs(batch: Mapping) -> int:
    rows = _rows(batch)
    if rows % 2:
        raise IndivisibleBatch(f"a paired batch must hold [chosen; rejected] rows, an even number; it has {rows}")
    return rows // 2


def _take_pairs(batch: Mapping, lo: int, hi: int) -> dict:
    rows = _rows(batch)
    half = rows // 2
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v) and v.dim() > 0:
            if v.shape[0] == rows:
                out[k] = torch.cat([v[lo:hi], v[half + lo:half + hi]])
            elif v.shape[0] == half:
                out[k] = v[lo:hi]
            else:
                raise IndivisibleBatch(
                    f"paired batch key {k!r} has {v.shape[0]} entries along dim 0; expected {rows} (rows) or "
                    f"{half} (pairs)"
                )
        elif isinstance(v, list | tuple) and len(v) == half:
            out[k] = v[lo:hi]
        else:
            out[k] = v
    return out


# --- flattened sequences --------------------------------------------------------------------------------------
def _sequence_starts(positions: torch.Tensor) -> torch.Tensor:
    """Indices where a new sequence begins: wherever positions do not continue by +1."""
    breaks = positions[1:] != positions[:-1] + 1
    return torch.cat([positions.new_zeros(1), breaks.nonzero().flatten() + 1])


def _boundaries(batch: Mapping) -> list[int]:
    """Token offsets [0, s_1, ..., T] of the sequences of a padding-free batch."""
    ids = next(v for v in batch.values() if torch.is_tensor(v) and v.dim() == 2)
    if ids.shape[0] != 1:
        raise IndivisibleBatch(
            f"a padding-free batch must be one row of concatenated sequences, but it has {ids.shape[0]} rows; "
            "hf_accum cannot cut packed rows"
        )
    total = int(ids.shape[1])
    cu = batch.get("cu_seq_lens_q")
    if torch.is_tensor(cu):
        return [int(x) for x in cu.tolist()]
    pos = batch.get("position_ids")
    if not torch.is_tensor(pos):
        raise IndivisibleBatch("a padding-free batch needs position_ids or cu_seq_lens_q to find its sequences")
    return [int(x) for x in _sequence_starts(pos[0]).tolist()] + [total]


def _sequences(batch: Mapping) -> int:
    return len(_boundaries(batch)) - 1


def _take_sequences(batch: Mapping, lo: int, hi: int) -> dict:
    bounds = _boundaries(batch)
    start, stop = bounds[lo], bounds[hi]
    total = bounds[-1]
    lengths = torch.tensor([b - a for a, b in zip(bounds[lo:hi], bounds[lo + 1:hi + 1])], device="cpu")  # host side
    out = {}
    for k, v in batch.items():
        if k in _FLAT_DERIVED:
            continue
        if k == "seq_idx" and torch.is_tensor(v):
            out[k] = v[:, start:stop] - v[:, start:start + 1]
        elif torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == total:
            out[k] = v[:, start:stop]
        elif torch.is_tensor(v) and v.dim() == 1 and v.shape[0] == total:
            out[k] = v[start:stop]
        elif torch.is_tensor(v) and v.dim() > 0 and k not in ("position_ids",):
            raise IndivisibleBatch(f"padding-free batch key {k!r} of shape {tuple(v.shape)} is not per-token")
        else:
            out[k] = v
    if "cu_seq_lens_q" in batch:
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(batch["cu_seq_lens_q"])
        for k in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if k in batch:
                out[k] = cu.clone()
        for k in ("max_length_q", "max_length_k"):
            if k in batch:
                out[k] = int(lengths.max())
    return out


_UNIT_COUNT = {"rows": _rows, "pairs": _pairs, "sequences": _sequences}
_TAKE = {"rows": _take_rows, "pairs": _take_pairs, "sequences": _take_sequences}


# --- padding --------------------------------------------------------------------------------------------------
def trim_padding(batch: dict, labels: LabelSpec) -> dict:
    """Cut trailing columns that are padding in every row (attention 0, every per-token label ignored).

    Only for token-level losses: per-token labels (or a per-token ``completion_mask``, as in preference data)
    must exist, so that padded positions provably take no part in the loss."""
    mask = batch.get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2:
        return batch
    per_token = [batch[k] for k in (labels.key, "shift_labels", "completion_mask")
                 if torch.is_tensor(batch.get(k)) and batch[k].shape == mask.shape]
    if not per_token:
        return batch
    keep = mask.bool().any(0)
    for t in (batch.get(labels.key), batch.get("shift_labels")):
        if torch.is_tensor(t) and t.shape == mask.shape:
            keep = keep | t.ne(labels.ignore_index).any(0)
    nz = keep.nonzero()
    length = int(nz.max()) + 1 if len(nz) else mask.shape[1]
    seq = mask.shape[1]
    return {k: v[:, :length] if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == seq else v
            for k, v in batch.items()}


def sliver(batch: Mapping, unit: str) -> dict:
    """The smallest forward of this batch's kind that still touches every parameter: one unit, two tokens."""
    if unit == "pairs":
        batch = _take_pairs(batch, 0, 1)
    elif unit == "sequences":
        batch = _take_sequences(batch, 0, 1)
    else:
        batch = _take_rows(batch, 0, 1)
    out = {k: v[:, :2] if torch.is_tensor(v) and v.dim() >= 2 else v for k, v in batch.items()}
    width = next(v.shape[1] for v in out.values() if torch.is_tensor(v) and v.dim() >= 2)
    for k in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if k in out:
            out[k] = torch.tensor([0, width], dtype=out[k].dtype, device=out[k].device)
    for k in ("max_length_q", "max_length_k"):
        if k in out:
            out[k] = width
    return out


def _device(batch: Mapping):
    return next((v.device for v in batch.values() if torch.is_tensor(v)), None)
