"""GRPO (TRL's `GRPOTrainer`): exact accumulation over one generation batch, cut into forwards of whole completions.

TRL 1.16's GRPO losses are each a sum over the generation batch divided by a count, so once the count is the
window's own, any cut of the window into forwards is exact:

    loss_type            TRL's normalization                                  the window's exact form (mode)
    dapo, cispo, vespo   token sum / completion tokens of the generation      the same ("tokens")
                         batch
    grpo, sapo           per-completion token mean, mean over the micro-      per-completion mean / completions
                         batch, / accumulation                                of the window ("samples")
    luspo                per-completion token sum, same                       per-completion sum / completions
    dr_grpo              token sum / (rows x max_completion_length),          token sum / (completions x
                         / accumulation                                       max_completion_length) ("samples")
    bnpo                 token mean of each micro-batch, / accumulation       depends on the cut: refused

One optimizer step is one generation batch, as TRL does by default (`steps_per_generation` = accumulation): the
target is completions per optimizer step (prompts x `num_generations`). At each window's start the mixin has TRL
generate and score the whole generation batch (`window`: TRL's own `_prepare_inputs`, rewards and advantages over
the whole batch), then cuts its slices into forwards of whole completion rows; each forward's `compute_loss` is
TRL's, made to return the mean over the forward's own count (`chunk`), which the mixin scales to its exact share; a
token loss without the entropy bonus is handed the window's count, as TRL hands it, and returns its share itself
(`share`), so with no target the steps are TRL's bit for bit (as is the one generation call, `generation_in_chunks`).
With `num_iterations` > 1 the next windows train on the same generation batch again (TRL's buffer). The entropy
filter and bonus are defined over the whole generation batch (grpo_entropy.py). Under a token budget
(micro_batching="tokens") a row's length is its prompt plus its completion's real length (`CompletionRows`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Mapping

import torch

from ...compat import trainer_internals, trl_internals
from ...planning.rows import rows_per_device
from ...window.loss import LabelSpec
from ...window.oom import guarded
from ...window.token_budget import plan_budget
from ...window.units import Cutter
from .adapter import TrainerAdapter
from .grpo_entropy import ENTROPY_MASK, bonus_mask, entropy_bonus_factor, with_entropy_masks

TOKEN_MEAN_LOSSES = frozenset({"dapo", "cispo", "vespo"})
SEQUENCE_MEAN_LOSSES = frozenset({"grpo", "sapo", "luspo", "dr_grpo"})
EXACT_LOSSES = TOKEN_MEAN_LOSSES | SEQUENCE_MEAN_LOSSES

# A completion token counts where TRL's loss mask (`completion_mask`) is 1: counted as labels that are not 0.
logger = logging.getLogger(__name__)

COMPLETION_TOKENS = LabelSpec(key="completion_mask", ignore_index=0, shift=False)


def normalization_for(loss_type: str) -> str:
    """What TRL's GRPO loss ``loss_type`` is a mean over, as hf_accum's loss_normalization."""
    return "tokens" if loss_type in TOKEN_MEAN_LOSSES else "samples"


def grpo_refusal(args, normalization: str) -> str | None:
    """Why a GRPO config cannot be accumulated exactly under ``normalization`` (None: it can). Run by
    `AccumGRPOConfig` when it is built and, for a plain `GRPOConfig`, when a class mixing `AccumulationMixin` into
    `GRPOTrainer` is constructed."""
    if normalization == "model":
        return None
    loss = args.loss_type
    if loss == "bnpo":
        return ("loss_type='bnpo' divides each forward's token sum by that forward's own tokens, so its loss depends "
                "on how the generation batch is cut into forwards. Use loss_type='dapo' (the token mean over the "
                "whole generation batch), or loss_normalization='model' for TRL's own accumulation.")
    if loss not in EXACT_LOSSES:
        return (f"loss_type={loss!r} is not known to hf_accum, which cannot make its accumulation exact. Use one of "
                f"{sorted(EXACT_LOSSES)}, or loss_normalization='model'.")
    if normalization != normalization_for(loss):
        return (f"loss_normalization={normalization!r} does not fit loss_type={loss!r}, a mean over "
                f"{'completion tokens' if normalization_for(loss) == 'tokens' else 'completions'}. Set "
                f"loss_normalization={normalization_for(loss)!r} (or leave it unset), or 'model' for TRL's own.")
    if args.steps_per_generation != args.gradient_accumulation_steps:
        return (f"steps_per_generation={args.steps_per_generation} differs from gradient_accumulation_steps="
                f"{args.gradient_accumulation_steps}: hf_accum trains one generation batch per optimizer step. Leave "
                "steps_per_generation and generation_batch_size unset, or set loss_normalization='model'.")
    if args.use_adaptive_entropy:
        return ("use_adaptive_entropy=True changes entropy_coef inside the window's last forward, which hf_accum does "
                "not rescale yet. Set use_adaptive_entropy=False (a static entropy_coef is exact), or "
                "loss_normalization='model'.")
    return None


def grpo_trainer_refusal(trainer) -> str | None:
    problem = grpo_refusal(trainer.args, trainer._normalization)
    if problem is None and trainer._normalization == "tokens" and trainer.tools:
        # the loss mask is then completion_mask x tool_mask; hf_accum counts completion_mask
        return ("tools mask the tool outputs out of a completion's loss, which hf_accum does not count yet. Use "
                "loss_type='grpo' (a mean over completions), or loss_normalization='model'.")
    return problem


class GRPOAdapter(TrainerAdapter):
    """The mixin's hooks over GRPOTrainer (see the module docstring)."""

    exact_eval = False  # evaluation generates too: TRL's own eval loss (a mean over its eval batches)

    def normalization(self, args) -> str:
        return normalization_for(args.loss_type)

    def label_spec(self, trainer) -> LabelSpec:
        return COMPLETION_TOKENS

    def window(self, trainer, batch_samples: list) -> list:
        # TRL's sampler loads the same generation batch steps_per_generation (= accumulation) times per window, and
        # num_iterations windows in a row; each window is the whole generation batch (one optimizer step)
        slices = trl_internals.grpo_reused_slices(trainer)
        cut = forward_rows(trainer, batch_samples[0])
        if slices is None:
            trainer.model.train()  # TRL's _prepare_inputs generates for training only in train mode
            # with no target, TRL's one generation call, as GRPOTrainer makes it (chunks would change the
            # sampling stream); with one, at most the plan's rows per forward at a time
            target = trainer.settings.target_batch_size
            with generation_in_chunks(trainer, (cut or trainer.args.per_device_train_batch_size) if target else None):
                rows = functools.partial(rows_per_device, trainer.args, cut)
                slices = trl_internals.grpo_generated_slices(trainer, batch_samples[0], rows)
        if trainer.args.top_entropy_quantile < 1.0:
            slices = with_entropy_masks(trainer, slices, cut)
        if trl_internals.grpo_entropy_bonus(trainer):
            # the bonus is a token mean over the window: its count, over every rank
            tokens = sum(bonus_mask(s).sum() for s in slices)
            trainer._hf_accum_entropy_tokens = trainer.accelerator.reduce(tokens, reduction="sum")
        return slices

    def prepared(self, inputs) -> bool:
        return isinstance(inputs, Mapping) and "completion_ids" in inputs and "advantages" in inputs

    def chunk(self, trainer, inputs, local_count):
        # TRL divides dapo's token sum by num_items_in_batch / world x accumulation / steps_per_generation, and the
        # other losses' means by the accumulation: with the window length 1 and this count, every loss type returns
        # the forward's own mean, which the mixin scales to its exact share of the window. A token loss (no entropy
        # bonus) is handed the window's count instead, as TRL hands it: it returns its share itself (`share`: 1),
        # with TRL's own float operations.
        count = local_count * trainer.accelerator.num_processes * trainer.args.steps_per_generation
        if self.share(trainer) is not None:
            count = trainer._engine.window.items.to(count.device, count.dtype) * trainer.args.steps_per_generation
        inputs = trimmed(inputs)
        factor = None
        if trl_internals.grpo_entropy_bonus(trainer):
            factor = entropy_bonus_factor(bonus_mask(inputs).sum(), trainer._hf_accum_entropy_tokens,
                                          trainer._engine.share(local_count), trainer.accelerator.num_processes)
        keep = inputs.pop(ENTROPY_MASK, None)
        return {**inputs, "num_items_in_batch": count}, forward_context(trainer, factor, keep)

    def share(self, trainer):
        engine = trainer._engine  # in a window (not the probe's lone steps, whose forwards return their own mean)
        if engine is None or engine.window is None or trainer.args.loss_type not in TOKEN_MEAN_LOSSES:
            return None
        if trl_internals.grpo_entropy_bonus(trainer):
            return None
        return torch.ones((), dtype=torch.float64, device=trainer.args.device)

    def cutter(self, cutter: Cutter) -> Cutter:
        return CompletionRows(cutter.unit, cutter.labels)

    def before_train(self, trainer) -> None:
        # The plan sets the micro-batch and accumulation; one generation batch per optimizer step follows from them.
        args = trainer.args
        args.steps_per_generation = args.gradient_accumulation_steps
        args.generation_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size

    def probe_batches(self, trainer, shortest: int | None = None):
        """GRPO's training step at its worst case: every completion max_completion_length tokens after the longest
        prompt of the training set (or probe_seq_len - max_completion_length prompt tokens), random tokens, the
        reference's log-probabilities in the batch where beta > 0 (as generation leaves them: its forward runs
        without gradients, at the plan's micro-batch, below the training step's peak). ``shortest`` (the token
        budget's shorter probes): completions of shortest - prompt tokens (at least 1), the prompt as long."""
        args = trainer.args
        completion = args.max_completion_length
        prompt = args.probe_seq_len - completion if args.probe_seq_len else longest_prompt(trainer)
        if prompt < 1:
            raise ValueError(f"probe_seq_len={args.probe_seq_len} leaves no prompt token after max_completion_length="
                             f"{completion}: set probe_seq_len to prompt + completion tokens.")
        if shortest is not None:
            completion = min(completion, max(1, shortest - prompt))
        vocab = trainer.model.config.get_text_config().vocab_size
        device = args.device

        def make_batch(micro: int) -> dict:
            g = torch.Generator().manual_seed(0)
            batch = {"prompt_ids": torch.randint(0, vocab, (micro, prompt), generator=g),
                     "prompt_mask": torch.ones(micro, prompt, dtype=torch.long),
                     "completion_ids": torch.randint(0, vocab, (micro, completion), generator=g),
                     "completion_mask": torch.ones(micro, completion, dtype=torch.long),
                     "advantages": torch.tensor([(-1.0) ** i for i in range(micro)]),
                     "num_items_in_batch": torch.tensor(micro * completion)}
            if trainer.beta != 0.0:
                batch["ref_per_token_logps"] = torch.zeros(micro, completion)
            return {k: v.to(device) for k, v in batch.items()}

        return make_batch, prompt + completion

    def check_data(self, trainer) -> bool:
        return False  # the rows are prompts: their completions do not exist yet


@contextlib.contextmanager
def forward_context(trainer, entropy_factor: float | None, keep: torch.Tensor | None):
    """One forward: the window length 1 (see `GRPOAdapter.chunk`), the entropy coefficient scaled by
    ``entropy_factor`` (None: no entropy bonus), the entropy filter's mask ``keep`` (None: no filter)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(trainer_internals.window_length_set(trainer, 1))
        if entropy_factor is not None:
            stack.enter_context(trl_internals.grpo_entropy_coef_scaled(trainer, entropy_factor))
        if keep is not None:
            stack.enter_context(trl_internals.grpo_entropy_mask_fixed(trainer, keep))
        yield


class CompletionRows(Cutter):
    """Rows of a generated batch: a row needs its prompt (the batch's width: left-padded) and its completion up to
    its last token in the loss mask (`completion_mask`; most completions end before max_completion_length), so a
    token budget (micro_batching="tokens") packs more short completions per forward. Each forward is then trimmed
    to its own longest completion (`trimmed`). The window's count does not depend on the cut: exact for every
    accepted loss type."""

    def lengths(self, batch: Mapping) -> list[int]:
        mask = batch["completion_mask"].bool()
        positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        last = (positions * mask).amax(1).clamp(min=1)  # a forward keeps at least one completion column
        return (last + batch["prompt_ids"].shape[1]).tolist()


def forward_rows(trainer, loaded: list) -> int | None:
    """Rows per no-gradient forward and per generation chunk of this generation batch: the plan's rows per forward,
    or under a token budget the rows it holds at the longest prompt loaded + max_completion_length (None: as
    loaded)."""
    engine = trainer._engine
    if engine is not None:
        cut, budget = engine.cut_units, engine.token_budget
    else:
        cut, budget = trainer.planner.cut(trainer.plan), plan_budget(trainer.plan)
    if budget is None:
        return cut
    prompt = max(trl_internals.grpo_prompt_lengths(trainer, [example["prompt"] for example in loaded]))
    return max(1, budget.rows(prompt + trainer.args.max_completion_length))


def generate_in_chunks(generate: Callable[[list], tuple], prompts: list, rows: int) -> tuple[tuple, int]:
    """``generate(prompts)`` -> (completion ids, log-probabilities or None), run over ``rows`` prompts at a time; an
    out-of-memory error re-runs that chunk with half as many rows (memory freed first). Returns the concatenated
    result and the rows that fitted (kept for the next generation batch)."""
    ids, logps, start = [], [], 0
    while start < len(prompts):
        part = prompts[start:start + rows]
        result, oom = guarded(functools.partial(generate, part))
        if oom:
            if rows == 1:
                raise RuntimeError("hf_accum: out of memory generating one completion at a time; nothing smaller to "
                                   "try. Lower max_completion_length, load the model in bfloat16, or free memory.")
            rows = max(1, rows // 2)
            logger.warning("hf_accum: out of memory in generation; generating %d prompts at a time", rows)
            continue
        ids.extend(result[0])
        logps = None if result[1] is None else [*(logps or []), *result[1]]
        start += len(part)
    return (ids, logps), rows


@contextlib.contextmanager
def generation_in_chunks(trainer, rows: int | None):
    """During one generation batch, TRL's transformers generation (not vLLM, not continuous batching, not images)
    runs in chunks of at most ``rows`` prompts (the plan's rows per forward; fewer after an OOM in generation), so
    the KV cache of the whole generation batch is never held at once. ``rows`` None (no target): TRL's one call, in
    chunks only after an OOM in it. Not under DeepSpeed or FSDP, whose generation gathers parameters with
    collectives: every rank must call it as often (TRL's one call is kept)."""
    own = trainer.__dict__.get("_generate_single_turn")  # a patched generation (tests) is chunked too
    original = own or trainer._generate_single_turn
    plain = not (trainer.use_vllm or trainer.args.use_transformers_continuous_batching
                 or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled)
    rows = min(filter(None, (rows, trainer.__dict__.get("_hf_accum_generation_rows"))), default=None)

    def chunked(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        if not plain or images is not None or multimodal_fields:
            return original(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        size = rows or len(prompt_ids)
        result, fitted = generate_in_chunks(
            lambda part: original(part, images, multimodal_fields, num_generations, *args, **kwargs), prompt_ids, size)
        if fitted < size or rows is not None:
            trainer._hf_accum_generation_rows = fitted
        return result

    trainer._generate_single_turn = chunked
    try:
        yield
    finally:
        if own is not None:
            trainer._generate_single_turn = own
        else:
            del trainer._generate_single_turn


def trimmed(inputs: Mapping) -> dict:
    """A forward's completions cut after its longest one: most completions end before max_completion_length, and
    the padding after them is masked out of the loss and, the model being causal, changes no earlier position. Every
    per-completion-token tensor (completion_ids, its masks, the stored log-probabilities) is cut alike; a loss that
    divides by max_completion_length (dr_grpo) reads it from the config, not from the width."""
    mask = inputs["completion_mask"]  # the loss mask is this (x tool_mask, which is 1 on padding)
    width = mask.shape[1]
    columns = mask.any(0).nonzero()
    keep = int(columns.max()) + 1 if len(columns) else 1
    if keep == width:
        return dict(inputs)
    return {k: v[:, :keep] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == width and k != "prompt_ids"
            and k != "prompt_mask" else v for k, v in inputs.items()}


def longest_prompt(trainer) -> int:
    """Tokens of the training set's longest prompt, as TRL tokenizes it for generation: once per training set (a
    token budget's shorter probes ask again, and a large set takes a while to tokenize)."""
    dataset = trainer.train_dataset
    known = trainer.__dict__.get("_hf_accum_longest_prompt")
    if known is not None and known[0] is dataset:
        return known[1]
    try:
        prompts = dataset["prompt"]
    except (TypeError, KeyError):
        raise ValueError("The training set's prompts cannot be read ahead (an iterable dataset): set probe_seq_len to "
                         "the longest prompt + max_completion_length tokens.") from None
    longest = max(trl_internals.grpo_prompt_lengths(trainer, list(prompts)))
    trainer._hf_accum_longest_prompt = (dataset, longest)
    return longest


GRPO = GRPOAdapter()

__all__ = ["EXACT_LOSSES", "GRPO", "GRPOAdapter", "grpo_refusal", "normalization_for"]
