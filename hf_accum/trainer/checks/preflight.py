"""What `train()` checks of the training data before any heavy work, so that a case that would train on a
silently different effective batch, or fail mid-run, is refused first with the argument and the fix.

- an empty training set (torch's sampler would fail with its own message);
- a training set smaller than target_batch_size: every optimizer step would be the whole, smaller epoch while
  the plan, the logs and the summary claim the target (only with a target: plain `TrainingArguments` keep
  transformers' behaviour);
- causal-LM rows whose `labels` do not align with `input_ids` token for token: the model shifts labels itself,
  so another length trains on misaligned targets (or fails after optimizer steps were taken);
- ``micro_batching="tokens"`` with a given ``max_tokens_per_forward``: an example longer than the budget could
  never be forwarded (the probe's own budget always holds the longest example, or nothing fits and it says so);
- an empty example (``input_ids`` of length 0): it trains nothing, and a window of such rows would fail mid-run;
- ``loss_normalization="tokens"`` with no counted label in the whole training set (every label -100, or the
  collator gives none): every window would fail at its first step, after the probe. Read through the trainer's
  own collator, stopping at the first batch that counts a label, with the RNG streams left as they were.

Iterable datasets have no length and cannot be read ahead; they are not checked here. A Trainer subclass whose
`get_train_dataloader` returns its own iterable is read through the batches it yields (or, with no length, skipped
with one log line).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from ...config.paths import can_create_in, nearest_existing
from ...config.settings import Settings
from ...planning.data_scan import is_sequence, rows
from ...window.loss import loss_shifts_labels

logger = logging.getLogger(__name__)


def check_training_data(trainer) -> None:
    dataset = trainer.train_dataset
    if dataset is None:
        return  # transformers' own "training requires a train_dataset"
    try:
        size = len(dataset)
    except TypeError:
        return
    args = trainer.args
    target = Settings(args).exact_target()
    if size == 0:
        raise ValueError(
            f"train_dataset is empty (0 rows): there is nothing to train on. Pass a training set with at least "
            f"{target} rows (one optimizer step of {_target_name(args)}={target})."
        )
    _check_no_empty_rows(dataset)
    _check_batches(trainer, counts=trainer._normalization == "tokens")  # the unit it really normalizes by
    from ...args import AccumTrainingArguments

    if not isinstance(args, AccumTrainingArguments):
        return  # plain TrainingArguments: transformers' Trainer behaviour, nothing more
    if args.target_batch_size and size < target:
        world = args.world_size
        fits = (size // world) * world
        fix = (f"Set target_batch_size to at most {fits}" if fits else
               f"Train on at least {world} rows (one per data-parallel rank)")
        raise ValueError(
            f"{_target_name(args)}={target} is larger than the training set ({size} rows): every optimizer step "
            f"would use the whole epoch, {size} samples, not {target}. {fix}, or add training data."
        )
    if loss_shifts_labels(trainer.model):
        _check_label_alignment(dataset)
    if args.micro_batching == "tokens" and args.max_tokens_per_forward is not None and not args.tunes:
        # a budget the user gave; one the probe measured (a recipe tunes first, then trains with auto_tune off)
        # holds the longest example by construction
        _check_token_budget(dataset, args.max_tokens_per_forward)


def _target_name(args) -> str:
    if Settings(args).target_batch_size:
        return "target_batch_size"
    return "per_device_train_batch_size x gradient_accumulation_steps x world size"


def _check_label_alignment(dataset) -> None:
    for index, ids, labels in rows(dataset):
        if not (is_sequence(ids) and is_sequence(labels)):
            continue
        if len(labels) != len(ids):
            raise ValueError(
                f"train_dataset row {index}: labels has {len(labels)} entries but input_ids {len(ids)}. A causal "
                "LM shifts labels itself, so labels must align with input_ids token for token: copy input_ids and "
                "set -100 where no loss is wanted (prompt, padding)."
            )


def _check_token_budget(dataset, budget: int) -> None:
    for index, ids in rows(dataset, ("input_ids",)):
        if is_sequence(ids) and len(ids) > budget:
            raise ValueError(
                f"train_dataset row {index} has {len(ids)} tokens, more than max_tokens_per_forward={budget}: it "
                f"cannot be forwarded alone. Truncate examples to at most {budget} tokens (tokenizer(..., "
                "truncation=True, max_length=...)), or raise max_tokens_per_forward (enable gradient_checkpointing "
                "so more tokens fit), or let the probe measure the budget (set target_batch_size, auto_tune=True)."
            )


def _check_no_empty_rows(dataset) -> None:
    for index, ids in rows(dataset, ("input_ids",)):
        if is_sequence(ids) and len(ids) == 0:
            raise ValueError(
                f"train_dataset row {index} is empty (input_ids has 0 tokens): there is nothing in it to train on. "
                "Remove empty examples before training (e.g. dataset.filter(lambda row: len(row['input_ids']) > 0))."
            )


def _check_batches(trainer, counts: bool, rows_per_batch: int = 64) -> None:
    """The collator gives what a model takes: a mapping of tensors (a list where a tensor goes fails deep inside the
    first forward); and, where the loss is a token mean (``counts``), at least one label counts somewhere in the
    training set, as the trainer's collator gives the batches."""
    from ...probing.preserve import modes_and_rng_preserved

    loader = trainer.get_train_dataloader()
    spec = trainer._label_spec()
    with modes_and_rng_preserved(trainer.model):  # a collator may draw random numbers (masking): none consumed
        batches = _batches(loader, rows_per_batch)
        if batches is None:
            return
        for batch in batches:
            if not isinstance(batch, Mapping):
                logger.info("hf_accum: the training labels are not checked before the probe (the loader yields "
                            "%s, not a mapping of tensors).", type(batch).__name__)
                return
            _check_tensors(batch)
            if not counts or int(spec.count(batch)):
                return
    raise ValueError(
        f"Every label of the training set is ignored ({spec.key!r} is {spec.ignore_index} everywhere, after the "
        "causal shift where the model shifts labels), so loss_normalization='tokens' has nothing to average over "
        "and no optimizer step could be taken. Check that the collator masks only prompt and padding tokens (a "
        "response cut away by truncation leaves none: raise max_length), or set loss_normalization='samples'."
    )


def _check_tensors(batch: Mapping) -> None:
    for key, value in batch.items():
        if isinstance(value, (list, tuple)):
            raise ValueError(
                f"data_collator returned {key!r} as a Python {type(value).__name__}, not a tensor: return torch "
                "tensors from the collator (e.g. tokenizer.pad(..., return_tensors='pt'), DataCollatorWithPadding).")


def check_model_computes_a_loss(trainer) -> None:
    """A transformers base model (`LlamaModel`, `BertModel`: no head) returns hidden states and no loss, and its
    forward takes no labels (transformers' Trainer then drops the labels column, and the collator fails on it), so
    there is nothing to train: refused in one line unless the trainer computes the loss itself."""
    import inspect

    from transformers import PreTrainedModel

    from ...compat.trainer_internals import computes_own_loss

    model = trainer.model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a PEFT adapter
    if computes_own_loss(trainer) or not isinstance(model, PreTrainedModel) or model.base_model is not model:
        return
    taken = inspect.signature(model.forward).parameters
    if any(name in taken for name in ("labels", *(trainer.args.label_names or ()))):
        return
    name = type(model).__name__
    raise ValueError(f"{name} has no head and returns no loss: load it with its task's head (AutoModelForCausalLM, "
                     f"or {name.removesuffix('Model')}ForCausalLM), or pass compute_loss_func.")


def _batches(loader, rows_per_batch: int):
    """The training set's batches as the trainer's collator gives them: read from the loader's dataset in order
    where it has one (no sampler, no shuffling), else the batches a custom loader yields; None, said in one line,
    where neither can be read ahead (a loader with no length may never end)."""
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if dataset is not None and collate is not None:
        try:
            size = len(dataset)
        except TypeError:
            return None
        return (collate([dataset[i] for i in range(start, min(size, start + rows_per_batch))])
                for start in range(0, size, rows_per_batch))
    try:
        len(loader)
    except TypeError:
        logger.info("hf_accum: the training data is not checked before the probe (%s has no length, so it cannot "
                    "be read ahead); a batch with no counted label is refused when it is trained.",
                    type(loader).__name__)
        return None
    return loader


def check_output_dir_writable(output_dir: str) -> None:
    """The plan file goes to ``output_dir`` after the probe: a place that cannot be written fails first."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"output_dir={output_dir!r} is a file; pass output_dir=DIR with a directory.")
    parent = nearest_existing(output_dir)
    if not can_create_in(parent):
        raise ValueError(f"output_dir={output_dir!r} cannot be written ({parent} is not writable); pass a "
                         "writable output_dir.")

