"""TRL: `SFTTrainer` with hf_accum's memory-planned batch and exact loss normalization.

    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer   # was: from trl import SFTConfig, SFTTrainer

    args = AccumSFTConfig(output_dir="out", target_batch_size=64, max_length=1024, ...)
    trainer = AccumSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.train()   # probes, plans micro x accumulation x world = 64, trains with the exact token mean

`AccumSFTConfig` is `SFTConfig` + `AccumTrainingArguments` (one dataclass: every field of both is a keyword, a
CLI flag for `HfArgumentParser` and a YAML key; both `__post_init__` checks run). `AccumSFTTrainer` is
`SFTTrainer` with `AccumulationMixin` in front: `SFTTrainer.training_step` (activation offloading context) and
`compute_loss` (TRL's fused LM head, its metrics) run unchanged inside hf_accum's window scaling. A user's own
`class MyTrainer(AccumulationMixin, trl.SomeTrainer)` gets what `TRL_TRAINERS` says of that trainer: its batch unit
(DPOTrainer and RewardTrainer: whole pairs) and checks, or a refusal at construction naming what to use instead.

`AccumRewardTrainer` / `AccumRewardConfig` do the same for `RewardTrainer` (whole pairs, the mean over the window's
pairs). `AccumDPOTrainer` / `AccumDPOConfig` do the same for `DPOTrainer`: batches are cut into whole preference pairs
(row i with row B+i), the loss is normalized over the window's pairs ("samples"), and loss types that are not a
mean of per-pair terms are refused.

What the mixin adds over TRL's own normalization: the tuner (`target_batch_size`, `auto_tune`), OOM recovery,
`check_accumulation`, and the exact mean across data-parallel ranks whatever `average_tokens_across_devices`
says (it is turned off, logged, because hf_accum counts across ranks itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import Trainer

try:
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - trl is in the dev extra, optional for users
    raise ImportError(f"hf_accum.trl needs TRL ({exc}): pip install trl") from exc

from . import _compat, router_aux
from .args import AccumTrainingArguments
from .trainer import AccumulationMixin

# TRL's configs default gradient_checkpointing to True; an unset flag (None) lets the tuner choose per layer instead
# (args.AccumTrainingArguments.checkpoint_layers). An explicit True/False is obeyed.
_FLAG_METADATA = {
    "help": "Gradient checkpointing on every layer (True) or none (False). Unset (hf_accum's default, unlike TRL's True): "
            "with the auto-tuner, checkpoint_layers='auto' chooses how many layers recompute; without it, off.",
    "nargs": "?",
    "const": True,
}


@dataclass
class AccumSFTConfig(SFTConfig, AccumTrainingArguments):
    """`trl.SFTConfig` with hf_accum's fields (target_batch_size, auto_tune, loss_normalization, ...).

    SFTConfig's defaults win where both define a field (e.g. learning_rate 2e-5, logging_steps 10), except TRL's
    default gradient_checkpointing=True, which counts as unset: with the tuner, checkpoint_layers="auto" chooses."""

    gradient_checkpointing: bool | None = field(default=None, metadata=_FLAG_METADATA)


class _TRLAccumulation(AccumulationMixin):
    """The mixin as hf_accum's TRL trainers use it. What every TRL trainer needs on top of the plain mixin comes with
    the mixin itself, for a user's own `class MyX(AccumulationMixin, trl.XTrainer)` too: the batch unit and the
    refusals (`TRL_TRAINERS`), no skipped forward on one rank (TRL gathers metrics inside `compute_loss`), and the
    probe's / accumulation check's steps kept out of TRL's metrics (`_compat.trl_metrics_kept`)."""


class AccumSFTTrainer(_TRLAccumulation, SFTTrainer):
    """`trl.SFTTrainer` + hf_accum: pass an `AccumSFTConfig` (plain `SFTConfig` works too: tokens
    normalization, no tuning).

    The fused loss here is TRL's own (`add_fused_lm_head`, exact: the sum of token log-probabilities over
    `num_items_in_batch`), so hf_accum installs no patch of its own. `fused_loss=False` turns TRL's fused head off:
    the loss is `Trainer.compute_loss`, the model's own loss from its full logits (TRL's entropy and token accuracy
    metrics are then not logged). A PEFT adapter on `lm_head` is refused: the fused head reads the base weight and
    would leave it untrained (TRL >= 1.16 refuses it itself; `modules_to_save` copies of lm_head are trained)."""

    _lm_head_fused_by = "TRL's fused LM head (trl.trainer.utils.add_fused_lm_head)" if _compat.trl_fuses_lm_head() else None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(self.model.get_output_embeddings(), BaseTunerLayer):
            raise ValueError(
                "A PEFT adapter on lm_head is not supported by AccumSFTTrainer: TRL's fused LM head multiplies by the "
                "base lm_head weight, so the adapter would stay untrained. Remove lm_head from target_modules (use "
                "modules_to_save=['lm_head'] to train the head)."
            )
        if getattr(self.args, "fused_loss", None) is False and self.args.loss_type != "nll":
            raise ValueError(
                f"fused_loss=False computes the model's own (nll) loss, but loss_type={self.args.loss_type!r} needs "
                "TRL's fused LM head. Leave fused_loss unset, or set loss_type='nll'."
            )
        if getattr(self.args, "fused_loss", None) is False and router_aux.enabled(self):
            raise ValueError(
                "fused_loss=False computes the model's own loss, which adds the MoE router loss inside each forward's "
                "token mean, so hf_accum cannot give it TRL's weight (its mean over the window's forwards). Leave "
                "fused_loss unset, or set router_aux_loss_coef=0.0."
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if getattr(self.args, "fused_loss", None) is False:
            inputs = {**inputs, "use_cache": False}
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


# DPO losses whose batch loss is the mean over pairs of a term of that pair alone: cutting a window into forwards
# of whole pairs and re-weighting them by pair count gives the window's mean exactly; "sft", a token mean over the
# chosen completions, gets its own count over the window (dpo_sft.py). The others are refused: "aot"/"aot_unpaired"
# sort the ratios across the batch, "bco_pair" (as issue-tracked) is not admitted until tested.
PER_PAIR_DPO_LOSSES = frozenset({"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "sppo_hard",
                                 "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft"})


@dataclass
class AccumDPOConfig(DPOConfig, AccumTrainingArguments):
    """`trl.DPOConfig` with hf_accum's fields. ``loss_normalization`` defaults to "samples": DPO's loss is a mean
    over preference pairs, and one pair is one sample of the effective batch."""

    loss_normalization: str = "samples"
    gradient_checkpointing: bool | None = field(default=None, metadata=_FLAG_METADATA)

    def __post_init__(self):
        super().__post_init__()
        problem = dpo_refusal(self, self.loss_normalization)
        if problem:
            raise ValueError(problem)


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


class AccumDPOTrainer(_TRLAccumulation, DPOTrainer):
    """`trl.DPOTrainer` + hf_accum: exact accumulation over the window's preference pairs (DPOTrainer alone
    weights a shorter last window's pairs differently), OOM recovery that cuts whole pairs, the tuner. The batch
    unit (pairs) and the checks come from `TRL_TRAINERS`, as for any class mixing `AccumulationMixin` into
    `DPOTrainer`."""


def _dpo_trainer_refusal(trainer) -> str | None:
    # An MoE router loss is not refused: it is averaged over the window's forwards, as TRL does (router_aux.py).
    return dpo_refusal(trainer.args, trainer._normalization)


def _reward_refusal(normalization: str) -> str | None:
    if normalization == "tokens":
        return ("loss_normalization='tokens' does not fit RewardTrainer: its loss is a mean over preference pairs. "
                "Set loss_normalization='samples' (one pair = one sample), or 'model' for TRL's own.")
    return None


def _reward_trainer_refusal(trainer) -> str | None:
    return _reward_refusal(trainer._normalization)


@dataclass
class AccumRewardConfig(RewardConfig, AccumTrainingArguments):
    """`trl.RewardConfig` with hf_accum's fields. ``loss_normalization`` defaults to "samples": the reward loss
    (-logsigmoid of the margin, plus the optional centering term) is a mean over preference pairs."""

    loss_normalization: str = "samples"
    gradient_checkpointing: bool | None = field(default=None, metadata=_FLAG_METADATA)

    def __post_init__(self):
        super().__post_init__()
        problem = _reward_refusal(self.loss_normalization)
        if problem:
            raise ValueError(problem)


class AccumRewardTrainer(_TRLAccumulation, RewardTrainer):
    """`trl.RewardTrainer` + hf_accum: exact accumulation over the window's preference pairs (whole pairs per
    forward, also after an OOM), the tuner. As for any class mixing `AccumulationMixin` into `RewardTrainer`."""


@dataclass(frozen=True)
class MixedInto:
    """What `AccumulationMixin` does over one TRL trainer: ``unit`` of its batches (None: rows, or padding-free
    sequences, detected from each batch), the loss normalization where the config has no ``loss_normalization``
    field (a plain TRL config), the check of the constructed trainer (a message when it cannot be exact), or
    ``refusal``: why hf_accum cannot cut its batches exactly, and what to use instead."""

    unit: str | None = None
    normalization: str = "tokens"
    check: Callable[[Any], str | None] | None = None
    refusal: str | None = None


_GENERATION_GROUPS = (
    "its rows are groups of num_generations completions of one prompt, generated inside the training loop, and its "
    "advantages and loss normalization span the whole generation batch, so a window cannot be cut into smaller "
    "forwards exactly ({name} accumulates over its generation batch itself: steps_per_generation). Use {name} "
    "without AccumulationMixin"
)

# The TRL trainers (as `trl` exports them; tests/test_trl_mixins.py pins that these are exactly the Trainer
# classes in trl's namespace) and what the mixin does over each. A TRL class missing here is refused.
TRL_TRAINERS: dict[str, MixedInto] = {
    "SFTTrainer": MixedInto(),  # a token mean (or a sample mean with loss_normalization="samples")
    "DPOTrainer": MixedInto("pairs", "samples", check=_dpo_trainer_refusal),  # [chosen; rejected], per-pair terms
    "RewardTrainer": MixedInto("pairs", "samples", check=_reward_trainer_refusal),  # per-pair logsigmoid (+ centering)
    "KTOTrainer": MixedInto(refusal=(
        "its loss compares each sample with a KL estimate averaged over the whole batch (mismatched prompt/completion "
        "rows, gathered over ranks), so cutting a batch into smaller forwards changes every sample's term. Use "
        "KTOTrainer without AccumulationMixin")),
    "GRPOTrainer": MixedInto(refusal=_GENERATION_GROUPS.format(name="GRPOTrainer")),
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
    known = TRL_TRAINERS.get(name) if getattr(trl, name, None) is base else None
    if known is None:
        return f"{base.__module__}.{name}", MixedInto(refusal=(
            "hf_accum does not know the unit of its batches (rows, pairs, groups), so it cannot cut them exactly. "
            f"Use {name} without AccumulationMixin, or a trainer hf_accum supports ({', '.join(TRL_TRAINERS)})"))
    return f"trl.{name}", known


# With TRL's fused head, SFTTrainer.compute_loss reads no logits: resolve_fused_loss must not count it (or ours) as a
# user override. Older TRL reads the logits for its token accuracy: hf_accum's fused loss stays off there.
AccumSFTTrainer._fused_compute_loss_classes = (SFTTrainer, AccumSFTTrainer) if _compat.trl_fuses_lm_head() else ()

__all__ = ["TRL_TRAINERS", "AccumDPOConfig", "AccumDPOTrainer", "AccumRewardConfig", "AccumRewardTrainer",
           "AccumSFTConfig", "AccumSFTTrainer", "AccumulationMixin", "mixed_into"]
