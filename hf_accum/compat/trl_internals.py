"""TRL internals hf_accum touches: the metrics TRL gathers inside compute_loss (kept out of the probe's steps)
and whether TRL fuses the LM head. Pinned by tests/test_trl.py and tests/test_compat.py.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def trl_metrics_untouched(trainer):
    """TRL trainers append to `_metrics` and count `_total_train_tokens` in `compute_loss`; the probe's and the
    accumulation check's steps are not training, so both are restored after them."""
    import copy

    metrics = copy.deepcopy(trainer.__dict__.get("_metrics"))
    tokens = trainer.__dict__.get("_total_train_tokens")
    try:
        yield
    finally:
        if metrics is not None:
            trainer._metrics = metrics
        if tokens is not None:
            trainer._total_train_tokens = tokens


def trl_metrics_kept(method):
    """``method`` of a trainer run under `trl_metrics_untouched` (a no-op for trainers that keep no TRL metrics)."""
    import functools

    @functools.wraps(method)
    def wrapped(trainer, *args, **kwargs):
        with trl_metrics_untouched(trainer):
            return method(trainer, *args, **kwargs)

    return wrapped


def trl_counts_tokens(trainer) -> bool:
    """Whether ``trainer`` keeps TRL's `num_tokens` metric (`_total_train_tokens`, counted in `compute_loss`). TRL logs
    it at evaluation too, as ``eval_num_tokens``: the training tokens seen so far, not the evaluation's."""
    return "_total_train_tokens" in vars(trainer)


def trl_fuses_lm_head() -> bool:
    """Whether TRL's SFTTrainer computes its loss through `add_fused_lm_head` (a patched `model.forward` called with
    `fused_lm_head=True`, TRL >= 1.x) rather than from the model's logits."""
    try:
        from trl.trainer import utils
    except ImportError:
        return False
    return hasattr(utils, "add_fused_lm_head")


def grpo_generated_slices(trainer, loaded, rows_per_forward=contextlib.nullcontext) -> list[dict]:
    """One generation batch of TRL's GRPOTrainer, generated and scored now, as its `steps_per_generation` slices.

    `GRPOTrainer._prepare_inputs` generates when its step counter starts a generation cycle or when its buffer
    `_buffered_inputs` is empty (a resumed run), keeps the batch shuffled and cut into `steps_per_generation`
    slices there, and returns one. hf_accum needs the whole generation batch at the start of each optimizer step,
    so it empties the buffer (as a resume does) and takes every slice. TRL runs the no-gradient forwards of
    generation (the reference's log-probabilities, where beta > 0) in chunks of per_device_train_batch_size rows:
    ``rows_per_forward()`` is the context that sets it to the plan's rows per forward (the planner's, given by the
    caller: compat/ does not reach into planning/). Pinned by tests/test_compat.py."""
    trainer._buffered_inputs = None
    with rows_per_forward():
        trainer._prepare_inputs(loaded)
    return list(trainer._buffered_inputs)


def grpo_prompt_lengths(trainer, prompts: list) -> list[int]:
    """Tokens of each prompt as GRPOTrainer generates from it (`_tokenize_prompts`: its chat template, tools)."""
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    return [len(ids) for ids in prompt_ids]


def prepared_dataset(task: str, dataset, tokenizer, args):
    """``dataset`` tokenized (and truncated, packed) as TRL's SFTTrainer (``task`` "causal_lm") or DPOTrainer ("dpo")
    prepares its train dataset, without a model: their `_prepare_dataset`, run on a stand-in holding only what it
    reads of the trainer (the tokenizer; SFT's chat template and completion-only switch, as its __init__ sets them).
    The estimate reads the longest example from it, as the probe reads it from the trainer's own."""
    from types import SimpleNamespace

    from trl import DPOTrainer, SFTTrainer

    if task == "dpo":
        return DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), dataset, tokenizer, args, "train")
    first = dataset[0]
    completion_only = (args.completion_only_loss if args.completion_only_loss is not None
                       else "prompt" in first and "completion" in first)
    stand_in = SimpleNamespace(_tokenizer=tokenizer, chat_template=None, completion_only_loss=completion_only)
    return SFTTrainer._prepare_dataset(stand_in, dataset, tokenizer, args, args.packing, None, "train")
