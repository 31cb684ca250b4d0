"""What `Seq2SeqTrainer` (transformers 5.x) generates with, read and set where it keeps it.

`Seq2SeqTrainer.evaluate` / `predict` store the generation keyword arguments of the call in the private
``_gen_kwargs`` (``max_length`` from ``generation_max_length`` and ``num_beams`` from ``generation_num_beams`` when
the call names neither), then `prediction_step` generates with them when ``predict_with_generate`` is on and the
step is not loss-only. The eval batch is measured (planning/eval_batch.py) before `Seq2SeqTrainer.evaluate` stores
them, so `generating_at_full_length` stores them first, with the output held at its longest (a model that stops
early would measure too little). Pinned by tests/compat/test_seq2seq_internals.py.
"""

from __future__ import annotations

import contextlib


def evaluation_generation_kwargs(trainer, given: dict) -> dict:
    """The generation kwargs `Seq2SeqTrainer.evaluate(**given)` stores in ``_gen_kwargs`` (its own rule)."""
    kwargs = dict(given)
    args = trainer.args
    if kwargs.get("max_length") is None and kwargs.get("max_new_tokens") is None \
            and args.generation_max_length is not None:
        kwargs["max_length"] = args.generation_max_length
    if kwargs.get("num_beams") is None and args.generation_num_beams is not None:
        kwargs["num_beams"] = args.generation_num_beams
    return kwargs


def full_length(kwargs: dict, generation_config) -> dict:
    """``kwargs`` with generation held to its longest output: no end-of-sequence before the length limit."""
    if kwargs.get("max_new_tokens") is not None:
        return {**kwargs, "min_new_tokens": kwargs["max_new_tokens"]}
    if kwargs.get("max_length") is None and generation_config.max_new_tokens is not None:
        return {**kwargs, "min_new_tokens": generation_config.max_new_tokens}
    longest = kwargs.get("max_length") or generation_config.max_length or 20  # GenerationConfig's default
    return {**kwargs, "max_length": longest, "min_length": longest}


@contextlib.contextmanager
def generating_at_full_length(trainer, given: dict):
    """Inside, `Seq2SeqTrainer.prediction_step` generates with what ``evaluate(**given)`` will use, at full length."""
    unset = object()
    before = getattr(trainer, "_gen_kwargs", unset)
    kwargs = evaluation_generation_kwargs(trainer, given)
    config = kwargs.get("generation_config") or trainer.accelerator.unwrap_model(trainer.model).generation_config
    trainer._gen_kwargs = full_length(kwargs, config)
    try:
        yield trainer._gen_kwargs
    finally:
        if before is unset:
            del trainer._gen_kwargs
        else:
            trainer._gen_kwargs = before
