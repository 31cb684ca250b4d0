"""TRL internals hf_accum touches: the metrics TRL gathers inside compute_loss (kept out of the probe's steps)
and whether TRL fuses the LM head. Pinned by tests/test_trl.py and tests/compat/test_compat.py.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path


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


def preference_collator_cut(collator) -> int | None:
    """The ``max_length`` TRL's DPO preference collator (`trl.trainer.dpo_trainer.DataCollatorForPreference`, built
    from ``DPOConfig.max_length``) cuts each prompt + completion row to; None for any other collator, or no cut."""
    try:
        from trl.trainer.dpo_trainer import DataCollatorForPreference
    except ImportError:
        return None
    return collator.max_length if isinstance(collator, DataCollatorForPreference) else None


def trl_fuses_lm_head() -> bool:
    """Whether TRL's SFTTrainer computes its loss through `add_fused_lm_head` (a patched `model.forward` called with
    `fused_lm_head=True`, TRL >= 1.x) rather than from the model's logits."""
    try:
        from trl.trainer import utils
    except ImportError:
        return False
    return hasattr(utils, "add_fused_lm_head")


def fused_lm_head_outputs(model) -> tuple[str, ...] | None:
    """The fields TRL's fused LM head computes on ``model`` (a transformers model, not a peft wrapper) when
    `add_fused_lm_head` patched it, else None. TRL keeps no marker: its patched ``forward`` is the closure
    ``_fused_forward`` (wrapped to look like the original), holding ``outputs`` among its free variables; a paper
    model calls it through a `functools.partial` (`add_trl_fused_head`)."""
    forward = model.__dict__.get("forward")
    while isinstance(forward, functools.partial):
        forward = forward.func
    func = getattr(forward, "__func__", None)
    code = getattr(func, "__code__", None)
    if code is None or code.co_name != "_fused_forward" or not code.co_filename.endswith(
            str(Path("trl", "trainer", "utils.py"))):
        return None
    cells = dict(zip(code.co_freevars, func.__closure__ or ()))
    if "outputs" not in cells:
        return None
    return tuple(cells["outputs"].cell_contents)


def grpo_generated_slices(trainer, loaded, rows_per_forward=contextlib.nullcontext) -> list[dict]:
    """One generation batch of TRL's GRPOTrainer, generated and scored now, as its `steps_per_generation` slices.

    `GRPOTrainer._prepare_inputs` generates when its step counter starts a generation cycle or when its buffer
    `_buffered_inputs` is empty (a resumed run), keeps the batch shuffled and cut into `steps_per_generation`
    slices there, and returns one. hf_accum needs the whole generation batch at the start of each optimizer step,
    so it empties the buffer (as a resume does) and takes every slice. TRL runs the no-gradient forwards of
    generation (the reference's log-probabilities, where beta > 0) in chunks of per_device_train_batch_size rows:
    ``rows_per_forward()`` is the context that sets it to the plan's rows per forward (the planner's, given by the
    caller: compat/ does not reach into planning/). Pinned by tests/compat/test_compat.py."""
    trainer._buffered_inputs = None
    with rows_per_forward():
        trainer._prepare_inputs(loaded)
    return list(trainer._buffered_inputs)


def grpo_reused_slices(trainer) -> list[dict] | None:
    """The slices of the last generation batch when this optimizer step trains on it again (None: generate).

    With `num_iterations` > 1, `GRPOTrainer._prepare_inputs` generates once every `steps_per_generation x
    num_iterations` of its micro-steps and otherwise returns the buffered slices again; with `steps_per_generation`
    = accumulation (hf_accum's layout) that is one generation every `num_iterations` optimizer steps. The batch
    then holds `old_per_token_logps` (TRL computes them at generation when the accumulation is not a multiple of
    that period), so the later steps' importance ratios are against the generating policy, as TRL's. An empty
    buffer (a resumed run) generates, as TRL does. Pinned by tests/compat/test_compat.py."""
    if trainer._buffered_inputs is None or trainer.state.global_step % trainer.num_iterations == 0:
        return None
    return list(trainer._buffered_inputs)


def grpo_entropy_bonus(trainer) -> bool:
    """Whether GRPOTrainer's `_compute_loss` subtracts the entropy bonus (`entropy_coef` x the token mean of the
    forward's entropies over its loss mask, divided by the accumulation)."""
    return trainer._entropy_bonus_enabled


@contextlib.contextmanager
def grpo_entropy_coef_scaled(trainer, factor: float):
    """GRPOTrainer's static `entropy_coef` times ``factor`` for one forward (`_compute_loss` reads it as the
    bonus's coefficient and logs it as the ``entropy_coef`` metric at the window's last forward: the metric keeps
    the user's value). Pinned by tests/compat/test_compat.py."""
    coef = trainer.entropy_coef
    logged = trainer._metrics["train"]["entropy_coef"]
    before = len(logged)
    trainer.entropy_coef = coef * factor
    try:
        yield
    finally:
        trainer.entropy_coef = coef
        logged[before:] = [coef] * (len(logged) - before)


def grpo_entropies(trainer, batch: dict, rows: int):
    """Per completion token entropies of the policy as it is now, as GRPOTrainer's training forward computes them
    (`_get_per_token_logps_and_entropies`, in chunks of ``rows``), without gradients (TRL's own no-gradient
    forwards: gradient checkpointing off)."""
    import torch
    from trl.models.utils import disable_gradient_checkpointing

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        _, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, batch["completion_ids"].shape[1], batch_size=rows, compute_entropy=True)
    return entropies


@contextlib.contextmanager
def grpo_entropy_mask_fixed(trainer, keep):
    """GRPOTrainer's `get_high_entropy_mask` (`_compute_loss`'s token filter, top_entropy_quantile < 1) returns
    ``keep`` (this forward's rows of a mask computed over the whole window) for one forward. Pinned by
    tests/compat/test_compat.py."""
    trainer.get_high_entropy_mask = lambda entropies, mask, threshold: keep.to(mask.device) & mask.bool()
    try:
        yield
    finally:
        del trainer.get_high_entropy_mask


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


SFT_HEAD_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what AccumSFTTrainer asks of TRL's fused head


def add_trl_fused_head(model, outputs: tuple[str, ...] = SFT_HEAD_OUTPUTS) -> None:
    """TRL's fused LM head on ``model`` (a transformers model, before LoRA wraps it) as AccumSFTTrainer runs it:
    `add_fused_lm_head` computing ``outputs``, and every call with ``fused_lm_head=True`` (the trainer passes it; the
    estimate's step calls ``model(**batch)``). One way for a recipe on paper
    (`recipes.recipe_paper`) and for the seed of a trainer's probe (`probing.seed`)."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=outputs)
    model.forward = functools.partial(model.forward, fused_lm_head=True)
