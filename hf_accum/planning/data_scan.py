"""The scan of the data: the one place the planning wing and the checks before training read the training or
evaluation examples ahead of training. Each example's length and the longest of them (the probe's worst case,
`probe_batches`; the eval batch's, planning/eval_batch.py), and the rows' token columns (`rows`: what preflight.py
checks, HF datasets read in batches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..compat import trainer_internals, trl_internals
from ..probing.probe import random_token_batch
from ..window.loss import loss_shifts_labels
from .probe_rows import collate_pads, collator_name, known_to_pad, probe_rows, sequence_length, stretched

logger = logging.getLogger(__name__)


def probe_batches(trainer, shortest: int | None = None,
                  lengths: list[int] | None = None) -> tuple[Callable[[int], dict[str, Any]], int]:
    """``make_batch(micro)`` at the worst-case length: the longest training example (`row_length`: as the trainer's
    collator will see it), collated ``micro`` times
    (or random tokens at ``probe_seq_len`` for causal LMs), and that length. ``shortest=n``: the shortest example
    of at least n tokens instead (the token-budget probe's second length; the longest when none is shorter).
    ``lengths``: the examples' lengths when already read (`train_lengths`)."""
    args = trainer.args
    if args.probe_seq_len is not None:
        if not loss_shifts_labels(trainer.model):
            raise ValueError(
                f"probe_seq_len={args.probe_seq_len} builds random causal-LM batches, but "
                f"{type(trainer.model).__name__} is not a causal LM. Leave probe_seq_len unset: the probe then "
                "measures with the longest training example."
            )
        length = min(args.probe_seq_len, max(shortest, args.probe_seq_len // 8)) if shortest else args.probe_seq_len
        return random_token_batch(trainer.model, length), length
    loader = trainer.get_train_dataloader()
    if not hasattr(loader, "dataset"):  # a trainer's own iterable (transformers' tests have one): scan its batches
        return _yielded_batches(trainer, loader)
    dataset, collate = loader.dataset, loader.collate_fn
    size = _length(dataset)
    if size is None:  # outside the except block: a refusal of an iterable set is not chained to its TypeError
        return _bounded_batches(trainer, dataset, collate)
    if size == 0:
        raise ValueError("train_dataset is empty: nothing to probe or train on.")
    if lengths is None:
        length = row_length(trainer)
        lengths = [length(dataset[i]) for i in range(size)]  # one pass over the data
    longest = longest_index(lengths)
    if shortest:
        candidates = [i for i in range(size) if lengths[i] >= shortest] or [longest]
        longest = min(candidates, key=lengths.__getitem__)
    example = dataset[longest]
    pads = known_to_pad(trainer.data_collator)
    if pads is None:  # found by collating two of the data's own rows of different lengths (one length: no padding)
        other = min(range(size), key=lengths.__getitem__)
        pads = lengths[other] != lengths[longest] and collate_pads(collate, [example, dataset[other]])
    return _collated(trainer, probe_rows(example, pads), collate, "the longest training example")


def _collated(trainer, rows, collate, what: str) -> tuple[Callable[[int], dict[str, Any]], int]:
    """``make_batch`` collating ``rows(micro)`` with the loader's collator, and the batch's length. A collator that
    fails on it is named in one line (it is the user's code; training's batches may differ from the probe's)."""
    def make_batch(micro: int) -> dict[str, Any]:
        try:
            batch = collate(rows(micro))
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(
                f"The data collator {collator_name(trainer.data_collator)} failed on the probe's batch ({micro} "
                f"copies of {what}): {type(exc).__name__}: {reason}. Fix the collator or the data, or set "
                "probe_seq_len to the longest sequence length training will see (the probe then measures random "
                "tokens, causal LMs only)."
            ) from None
        return trainer_internals.prepare_inputs(trainer, batch)

    return make_batch, _checked_length(trainer, make_batch(1))


def _checked_length(trainer, batch) -> int:
    seq_len = next((v.shape[1] for v in batch.values() if torch.is_tensor(v) and v.dim() >= 2), 1)
    max_positions = getattr(getattr(trainer.model, "config", None), "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(
            f"The longest training example is {seq_len} tokens after collation, beyond the model's "
            f"max_position_embeddings={max_positions}. Truncate examples to at most {max_positions} tokens "
            "(e.g. tokenizer(..., truncation=True, max_length=...))."
        )
    return int(seq_len)


def _length(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _bounded_batches(trainer, dataset, collate):
    """An iterable training set: its longest example is unknown, but a trainer that truncates (TRL's, to
    max_length) bounds it. The probe measures one real example stretched to that bound. Examples with no sequence
    at all (numbers, 0-d tensors: every one the same size) are measured from the first. Sequences with no bound:
    refused, with a fix that works for the model."""
    mixed = trainer._trl[1] if trainer._trl is not None else None  # the TRL trainer's record (integrations/trl)
    bound = mixed.length_bound(trainer) if mixed is not None and mixed.length_bound is not None else None
    with torch.random.fork_rng(devices=[]):  # reading it draws no random number training would
        example = next(iter(dataset), None)
    if example is None:
        raise ValueError("train_dataset is empty: nothing to probe or train on.")
    if bound is None and sequence_length(example) == 0:
        logger.warning("hf_accum: the training set is an iterable dataset of examples with no sequence (each one "
                       "the same size); the plan is measured on its first example.")
        return _collated(trainer, probe_rows(example, False), collate, "the first training example")
    if bound is None:
        fix = ("set probe_seq_len to the longest sequence length training will see" if loss_shifts_labels(trainer.model)
               else "give a sized train_dataset (a datasets.Dataset, or any dataset with __len__: the probe reads its "
               "longest example), or set auto_tune=False with per_device_train_batch_size x "
               "gradient_accumulation_steps x world size = target_batch_size")
        raise ValueError(f"The training set is an iterable dataset, so its longest example is unknown; {fix}.")
    n, why = bound
    logger.warning("hf_accum: the training set is an iterable dataset, so its longest example is unknown; the plan "
                   "is for examples of %d tokens, the longest %s lets through.", n, why)
    example = stretched(example, n) if isinstance(example, dict) else example
    pads = bool(known_to_pad(trainer.data_collator))
    return _collated(trainer, probe_rows(example, pads), collate, f"an example stretched to {n} tokens")


def _yielded_batches(trainer, loader):
    """A loader without ``.dataset`` (a trainer's own `get_train_dataloader`): the probe measures the widest batch it
    yields, its fullest row repeated ``micro`` times (one pass over the loader)."""
    with torch.random.fork_rng(devices=[]):  # a shuffling sampler draws its seed: training's order stays as it was
        batches = [b for b in loader if isinstance(b, dict)]
    if not batches:
        raise ValueError(f"get_train_dataloader() returned a {type(loader).__name__} that yields no batch of named "
                         "tensors: nothing to probe. Set auto_tune=False and give per_device_train_batch_size.")
    batch = max(batches, key=lambda b: _width(b) * _rows_in(b))
    rows = _rows_in(batch)
    mask = batch.get("attention_mask")
    row = int(mask.sum(-1).argmax()) if torch.is_tensor(mask) and mask.dim() == 2 else 0
    logger.info("hf_accum: get_train_dataloader() returned a %s without .dataset; the probe measures the widest "
                "batch it yields, one row repeated to each micro-batch.", type(loader).__name__)

    def make_batch(micro: int) -> dict[str, Any]:
        pick = torch.tensor([row] * micro)
        return trainer_internals.prepare_inputs(trainer, {
            k: v[pick] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == rows else v
            for k, v in batch.items()})

    return make_batch, _checked_length(trainer, make_batch(1))


def _rows_in(batch: dict) -> int:
    return next((v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() >= 1), 1)


def _width(batch: dict) -> int:
    return next((v.shape[1] for v in batch.values() if torch.is_tensor(v) and v.dim() >= 2), 1)


def train_lengths(trainer) -> list[int] | None:
    """Every training example's length as the trainer's collator will see it (`row_length`); None for an iterable
    dataset (`probe_batches` says what it plans from)."""
    dataset = trainer.train_dataset
    try:
        size = len(dataset)
    except TypeError:
        return None
    length = row_length(trainer)
    return [length(dataset[i]) for i in range(size)]


def row_length(trainer) -> Callable[[Any], int]:
    """``length(example)``: the width of the row ``trainer``'s collator builds for one training or evaluation
    example. A TRL preference trainer's pair is one row of prompt + the longer completion, wider than any one of its
    columns (its record's ``row_length``, `integrations/trl/support.py`, held by the mixin as ``trainer._trl``); any
    other example, or one not in the form its TRL trainer tokenizes, is its longest sequence. A collator that is not
    TRL's own is measured uncut: only TRL's is known to cut."""
    measure = trainer._trl[1].row_length if trainer._trl is not None else None
    if measure is None:
        return sequence_length
    cut = trl_internals.preference_collator_cut(trainer.data_collator)

    def length(example) -> int:
        n = measure(example, cut)
        return sequence_length(example) if n is None else n

    return length


def example_length(example) -> int:
    """An example's length: its input_ids (or inputs_embeds, pixel_values), else its longest sequence."""
    return sequence_length(example)


def longest_index(lengths: Sequence[int]) -> int:
    """The index of the longest example (the first of equals)."""
    return max(range(len(lengths)), key=lengths.__getitem__)


def rows(dataset, keys=("input_ids", "labels")):
    """(index, *values) of each row that has every key; HF datasets are read in batches."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and hasattr(dataset, "iter"):
        if not set(keys) <= set(columns):
            return
        start = 0
        for batch in dataset.select_columns(list(keys)).iter(batch_size=1000):
            for offset, values in enumerate(zip(*(batch[k] for k in keys))):
                yield start + offset, *values
            start += len(batch[keys[0]])
        return
    for index in range(len(dataset)):
        row = dataset[index]
        if isinstance(row, dict) and all(k in row for k in keys):
            yield index, *(row[k] for k in keys)


def is_sequence(value) -> bool:
    if hasattr(value, "shape"):
        return len(value.shape) == 1
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))
