"""The scan of the data: the one place the planning wing and the checks before training read the training or
evaluation examples ahead of training. Each example's length and the longest of them (the probe's worst case,
`probe_batches`; the eval batch's, planning/eval_batch.py), and the rows' token columns (`rows`: what preflight.py
checks, HF datasets read in batches).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..compat import trainer_internals
from ..loss import loss_shifts_labels
from ..probe import random_token_batch


def probe_batches(trainer, shortest: int | None = None,
                  lengths: list[int] | None = None) -> tuple[Callable[[int], dict[str, Any]], int]:
    """``make_batch(micro)`` at the worst-case length: the longest training example, collated ``micro`` times
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
    dataset, collate = loader.dataset, loader.collate_fn
    try:
        size = len(dataset)
    except TypeError:
        raise ValueError(
            "The training set is an iterable dataset, so its longest example is unknown; set probe_seq_len to the "
            "longest sequence length training will see."
        ) from None
    if size == 0:
        raise ValueError("train_dataset is empty: nothing to probe or train on.")
    if lengths is None:
        lengths = [example_length(dataset[i]) for i in range(size)]  # one pass over the data
    longest = longest_index(lengths)
    if shortest:
        candidates = [i for i in range(size) if lengths[i] >= shortest] or [longest]
        longest = min(candidates, key=lengths.__getitem__)
    example = dataset[longest]
    rows = _padded_rows(example, collate)

    def make_batch(micro: int) -> dict[str, Any]:
        return trainer_internals.prepare_inputs(trainer, collate(rows(micro)))

    first = make_batch(1)
    seq_len = next((v.shape[1] for v in first.values() if torch.is_tensor(v) and v.dim() >= 2), 1)
    max_positions = getattr(getattr(trainer.model, "config", None), "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(
            f"The longest training example is {seq_len} tokens after collation, beyond the model's "
            f"max_position_embeddings={max_positions}. Truncate examples to at most {max_positions} tokens "
            "(e.g. tokenizer(..., truncation=True, max_length=...))."
        )
    return make_batch, int(seq_len)


def train_lengths(trainer) -> list[int] | None:
    """Every training example's length; None for an iterable dataset (`probe_batches` says what to set)."""
    dataset = trainer.train_dataset
    try:
        return [example_length(dataset[i]) for i in range(len(dataset))]
    except TypeError:
        return None


def _padded_rows(example, collate) -> Callable[[int], list]:
    """``rows(micro)``: the example ``micro`` times; where the collator pads, the last one a token shorter, so
    the batch carries a padding mask as training's batches of mixed lengths do. A padding mask can cost more
    than the tokens (SDPA falls back to kernels that build the masked scores), and one pad token leaves the
    batch's real tokens, and so every per-token cost, as they were."""
    n = example_length(example)
    if not isinstance(example, dict) or n < 2:
        return lambda micro: [example] * micro
    shorter = {k: v[:-1] if hasattr(v, "__len__") and not isinstance(v, str) and len(v) == n else v
               for k, v in example.items()}
    mask = collate([example, shorter]).get("attention_mask")
    if not torch.is_tensor(mask) or mask.dim() != 2 or bool(mask.all()):
        return lambda micro: [example] * micro  # the collator does not pad (e.g. padding-free): nothing to mimic
    return lambda micro: [example] * (micro - 1) + [shorter] if micro > 1 else [example]


def example_length(example) -> int:
    """An example's length: its input_ids (or inputs_embeds, pixel_values), else its longest sequence."""
    if isinstance(example, dict):
        for key in ("input_ids", "inputs_embeds", "pixel_values"):
            if key in example:
                return len(example[key])
        return max((len(v) for v in example.values() if hasattr(v, "__len__") and not isinstance(v, str)), default=0)
    return len(example) if hasattr(example, "__len__") else 0


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
