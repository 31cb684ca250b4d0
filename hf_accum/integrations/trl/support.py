"""What `AccumulationMixin` does over each TRL trainer: the unit of its batches, the loss normalization of a plain
TRL config, the checks of a constructed trainer and the refusals (`TRL_TRAINERS`, `mixed_into`).

Apart from hf_accum/trl.py (the Accum* classes, which derive from the mixin) so that the mixin reads this table
without importing them: a user's own `class MyDPO(AccumulationMixin, trl.DPOTrainer)` needs it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import Trainer

from .adapter import NO_ADAPTER, TrainerAdapter
from .grpo import GRPO, grpo_trainer_refusal

# DPO losses whose batch loss is the mean over pairs of a term of that pair alone: cutting a window into forwards
# of whole pairs and re-weighting them by pair count gives the window's mean exactly; "sft", a token mean over the
# chosen completions, gets its own count over the window (dpo_sft.py). The others are refused: "aot"/"aot_unpaired"
# sort the ratios across the batch, "bco_pair" (as issue-tracked) is not admitted until tested.
PER_PAIR_DPO_LOSSES = frozenset({"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "sppo_hard",
                                 "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft"})


def dpo_refusal(args, normalization: str) -> str | None:
    """Why a DPO config cannot be accumulated exactly under ``normalization`` (None: it can). Run by
    `AccumDPOConfig` when it is built and, for a plain `DPOConfig`, when a class mixing `AccumulationMixin` into
    `DPOTrainer` is constructed."""
    if normalization == "tokens":
        return ("loss_normalization='tokens' does not fit DPO: its loss is a mean over preference pairs, not over "
                "tokens. Set loss_normalization='samples' (one pair = one sample), or 'model' for TRL's own.")
    if normalization != "samples":
        return None
    refused = sorted(set(args.loss_type) - PER_PAIR_DPO_LOSSES)
    if refused:
        return (f"loss_type={refused} is not a mean of per-pair terms, so hf_accum cannot make its accumulation "
                f"exact. Use one of {sorted(PER_PAIR_DPO_LOSSES)} (e.g. loss_type=['sigmoid']), or set "
                "loss_normalization='model' to train with TRL's own accumulation.")
    if args.padding_free:
        return ("padding_free=True flattens preference pairs into one row, which hf_accum cannot cut into whole "
                "pairs yet. Set padding_free=False, or loss_normalization='model'.")
    return None


def _dpo_trainer_refusal(trainer) -> str | None:
    # An MoE router loss is not refused: it is averaged over the window's forwards, as TRL does (router_aux.py).
    return dpo_refusal(trainer.args, trainer._normalization)


def dpo_row_length(example, max_length: int | None) -> int | None:
    """The width of the row DPOTrainer's collator builds for ``example``: its prompt followed by the longer of its
    completions (the chosen and rejected rows of a batch are padded to one width), cut to ``max_length`` (TRL's
    `DataCollatorForPreference` cuts prompt + completion, either end). None: not a tokenized pair (a vision
    dataset's rows are tokenized by their collator)."""
    if not isinstance(example, dict) or not {"prompt_ids", "chosen_ids", "rejected_ids"} <= example.keys():
        return None
    n = len(example["prompt_ids"]) + max(len(example["chosen_ids"]), len(example["rejected_ids"]))
    return n if max_length is None else min(n, max_length)


def reward_row_length(example, max_length: int | None = None) -> int | None:
    """The width of the row RewardTrainer's collator builds for ``example``: the longer of its chosen and rejected
    sequences (each already holds the prompt; RewardTrainer drops longer pairs rather than cutting them, so no
    ``max_length`` applies). None: not a tokenized pair."""
    if not isinstance(example, dict) or not {"chosen_ids", "rejected_ids"} <= example.keys():
        return None
    return max(len(example["chosen_ids"]), len(example["rejected_ids"]))


def reward_refusal(normalization: str) -> str | None:
    """Why RewardTrainer's loss cannot be accumulated exactly under ``normalization`` (None: it can)."""
    if normalization == "tokens":
        return ("loss_normalization='tokens' does not fit RewardTrainer: its loss is a mean over preference pairs. "
                "Set loss_normalization='samples' (one pair = one sample), or 'model' for TRL's own.")
    return None


def _reward_trainer_refusal(trainer) -> str | None:
    return reward_refusal(trainer._normalization)


@dataclass(frozen=True)
class MixedInto:
    """What `AccumulationMixin` does over one TRL trainer: ``unit`` of its batches (None: rows, or padding-free
    sequences, detected from each batch), the loss normalization where the config has no ``loss_normalization``
    field (a plain TRL config; the adapter's where it depends on the config), the check of the constructed trainer
    (a message when it cannot be exact), or ``refusal``: why hf_accum cannot cut its batches exactly, and what to use
    instead. ``adapter``: the mixin's hooks where the trainer builds its batches itself (GRPO generates them).
    ``row_length(example, cut)``: the width of the row its collator builds; ``length_bound(trainer)``: the longest
    sequence it lets through and why. The planner reads both from the record the mixin holds (`trainer._trl`), so
    planning/ never imports this module."""

    unit: str | None = None
    normalization: str = "tokens"
    check: Callable[[Any], str | None] | None = None
    refusal: str | None = None
    adapter: TrainerAdapter = NO_ADAPTER
    row_length: Callable[[Any, int | None], int | None] | None = None
    length_bound: Callable[[Any], tuple[int, str] | None] | None = None

    def normalization_of(self, args) -> str:
        """The loss normalization of a plain TRL config ``args`` for this trainer."""
        return self.adapter.normalization(args) or self.normalization


_GENERATION_GROUPS = (
    "its rows are groups of num_generations completions of one prompt, generated inside the training loop, and its "
    "advantages and loss normalization span the whole generation batch, so a window cannot be cut into smaller "
    "forwards exactly ({name} accumulates over its generation batch itself: steps_per_generation). Use {name} "
    "without AccumulationMixin"
)


def _truncating(name: str, how: str) -> Callable[[Any], tuple[int, str] | None]:
    """``length_bound(trainer)`` of a TRL trainer that cuts every sequence to ``max_length`` (SFT truncates while
    preparing the data, DPO's collator truncates prompt + completion, Reward drops longer pairs): with an iterable
    training set, whose longest example cannot be read ahead, that bound is the probe's worst case. None when nothing
    bounds it (``max_length=None``, or SFT told to skip its data preparation)."""

    def length_bound(trainer) -> tuple[int, str] | None:
        if trainer.args.max_length is None:
            return None
        if name == "SFTTrainer" and (trainer.args.dataset_kwargs or {}).get("skip_prepare_dataset"):
            return None
        n = int(trainer.args.max_length)
        return n, f"{type(trainer).__name__} with max_length={n} ({name} {how} to it)"

    return length_bound


# The TRL trainers (as `trl` exports them; tests/integrations/test_trl_mixins.py pins that these are exactly the Trainer
# classes in trl's namespace) and what the mixin does over each. A TRL class missing here is refused.
TRL_TRAINERS: dict[str, MixedInto] = {
    # a token mean (or a sample mean with loss_normalization="samples")
    "SFTTrainer": MixedInto(length_bound=_truncating("SFTTrainer", "truncates")),
    # [prompt + chosen; prompt + rejected], per-pair terms
    "DPOTrainer": MixedInto("pairs", "samples", check=_dpo_trainer_refusal, row_length=dpo_row_length,
                            length_bound=_truncating("DPOTrainer", "truncates")),
    # [chosen; rejected], per-pair logsigmoid (+ centering)
    "RewardTrainer": MixedInto("pairs", "samples", check=_reward_trainer_refusal, row_length=reward_row_length,
                               length_bound=_truncating("RewardTrainer", "filters")),
    "KTOTrainer": MixedInto(refusal=(
        "its loss compares each sample with a KL estimate averaged over the whole batch (mismatched prompt/completion "
        "rows, gathered over ranks), so cutting a batch into smaller forwards changes every sample's term. Use "
        "KTOTrainer without AccumulationMixin")),
    # rows of completions, generated per window (grpo.py); the normalization follows loss_type
    "GRPOTrainer": MixedInto("rows", check=grpo_trainer_refusal, adapter=GRPO),
    "RLOOTrainer": MixedInto(refusal=_GENERATION_GROUPS.format(name="RLOOTrainer")),
    "DistillationTrainer": MixedInto(refusal=(
        "it generates its completions inside the training loop for a whole accumulation window at once (as GRPO "
        "does), which hf_accum's window cannot re-cut. Use DistillationTrainer without AccumulationMixin")),
}


def mixed_into(cls: type) -> tuple[str, MixedInto] | None:
    """The TRL trainer ``cls`` derives from (its most derived TRL class) and what the mixin does over it; None when
    ``cls`` derives from no TRL class. A TRL class not in `TRL_TRAINERS` (an experimental or newer trainer) is
    refused: hf_accum does not know the unit of its batches."""
    import trl

    base = next((c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl" and issubclass(c, Trainer)), None)
    if base is None:
        return None
    name = base.__name__
    # trl's own class, or one a patch (unsloth, a test's swap) put in its place that derives from it
    public = getattr(trl, name, None)
    known = TRL_TRAINERS.get(name) if isinstance(public, type) and issubclass(public, base) else None
    if known is None:
        return f"{base.__module__}.{name}", MixedInto(refusal=(
            "hf_accum does not know the unit of its batches (rows, pairs, groups), so it cannot cut them exactly. "
            f"Use {name} without AccumulationMixin, or a trainer hf_accum supports ({', '.join(TRL_TRAINERS)})"))
    return f"trl.{name}", known


def dropped_by_truncation(given, prepared, args) -> str | None:
    """The line saying how many training examples SFTTrainer dropped because truncation to ``max_length`` left them
    no completion token (TRL filters them out without a word, so a run on half its data looks like any other); None
    when none were, or the counts cannot be compared (unsized data, packing: rows are not examples)."""
    if args.max_length is None or args.packing:  # SFTConfig: packed rows are not examples
        return None
    try:
        before, after = len(given), len(prepared)
    except TypeError:
        return None
    if after >= before:
        return None
    return (f"hf_accum: {before - after} of {before} training examples were dropped: truncated to "
            f"max_length={args.max_length} they keep no completion token (TRL drops them). To train on them, raise "
            "max_length or shorten their prompts.")

