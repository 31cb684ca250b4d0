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

import logging
from dataclasses import dataclass, field

from transformers import Trainer

try:
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - trl is in the dev extra, optional for users
    raise ImportError(f"hf_accum.trl needs TRL ({exc}): pip install trl") from exc

from .args import AccumTrainingArguments
from .compat import trl_internals
from .integrations.trl import router_aux
from .integrations.trl.grpo import grpo_refusal, normalization_for
from .integrations.trl.support import (  # noqa: F401 (public here)
    PER_PAIR_DPO_LOSSES,
    TRL_TRAINERS,
    MixedInto,
    dpo_refusal,
    dropped_by_truncation,
    mixed_into,
    reward_refusal,
)
from .planning.rows import rows_per_device
from .trainer.mixin import AccumulationMixin

logger = logging.getLogger("hf_accum.trainer")  # the trainer's messages, under the logger they always had

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
    probe's / accumulation check's steps kept out of TRL's metrics (`trl_internals.trl_metrics_kept`)."""


class AccumSFTTrainer(_TRLAccumulation, SFTTrainer):
    """`trl.SFTTrainer` + hf_accum: pass an `AccumSFTConfig` (plain `SFTConfig` works too: tokens
    normalization, no tuning).

    The fused loss here is TRL's own (`add_fused_lm_head`, exact: the sum of token log-probabilities over
    `num_items_in_batch`), so hf_accum installs no patch of its own. `fused_loss=False` turns TRL's fused head off:
    the loss is `Trainer.compute_loss`, the model's own loss from its full logits (TRL's entropy and token accuracy
    metrics are then not logged). A PEFT adapter on `lm_head` is refused: the fused head reads the base weight and
    would leave it untrained (TRL >= 1.16 refuses it itself; `modules_to_save` copies of lm_head are trained)."""

    _lm_head_fused_by = "TRL's fused LM head (trl.trainer.utils.add_fused_lm_head)" if trl_internals.trl_fuses_lm_head() else None

    def __init__(self, *args, **kwargs):
        import inspect

        given = inspect.signature(SFTTrainer.__init__).bind(self, *args, **kwargs).arguments.get("train_dataset")
        super().__init__(*args, **kwargs)
        dropped = dropped_by_truncation(given, self.train_dataset, self.args)
        if dropped:
            logger.warning(dropped)
        from peft.tuners.tuners_utils import BaseTunerLayer

        if isinstance(self.model.get_output_embeddings(), BaseTunerLayer):
            raise ValueError(
                "A PEFT adapter on lm_head is not supported by AccumSFTTrainer: TRL's fused LM head multiplies by the "
                "base lm_head weight, so the adapter would stay untrained. Remove lm_head from target_modules (use "
                "modules_to_save=['lm_head'] to train the head)."
            )
        if self.settings.fused_loss is False and self.args.loss_type != "nll":
            raise ValueError(
                f"fused_loss=False computes the model's own (nll) loss, but loss_type={self.args.loss_type!r} needs "
                "TRL's fused LM head. Leave fused_loss unset, or set loss_type='nll'."
            )
        if self.settings.fused_loss is False and router_aux.enabled(self):
            raise ValueError(
                "fused_loss=False computes the model's own loss, which adds the MoE router loss inside each forward's "
                "token mean, so hf_accum cannot give it TRL's weight (its mean over the window's forwards). Leave "
                "fused_loss unset, or set router_aux_loss_coef=0.0."
            )

    estimated_loss = "trl_fused_head"  # the loss `probing.seed` rebuilds on paper (this compute_loss, not a subclass's)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.settings.fused_loss is False:
            inputs = {**inputs, "use_cache": False}
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


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


class AccumDPOTrainer(_TRLAccumulation, DPOTrainer):
    """`trl.DPOTrainer` + hf_accum: exact accumulation over the window's preference pairs (DPOTrainer alone
    weights a shorter last window's pairs differently), OOM recovery that cuts whole pairs, the tuner. The batch
    unit (pairs) and the checks come from `TRL_TRAINERS`, as for any class mixing `AccumulationMixin` into
    `DPOTrainer`."""


@dataclass
class AccumRewardConfig(RewardConfig, AccumTrainingArguments):
    """`trl.RewardConfig` with hf_accum's fields. ``loss_normalization`` defaults to "samples": the reward loss
    (-logsigmoid of the margin, plus the optional centering term) is a mean over preference pairs."""

    loss_normalization: str = "samples"
    gradient_checkpointing: bool | None = field(default=None, metadata=_FLAG_METADATA)

    def __post_init__(self):
        super().__post_init__()
        problem = reward_refusal(self.loss_normalization)
        if problem:
            raise ValueError(problem)


class AccumRewardTrainer(_TRLAccumulation, RewardTrainer):
    """`trl.RewardTrainer` + hf_accum: exact accumulation over the window's preference pairs (whole pairs per
    forward, also after an OOM), the tuner. As for any class mixing `AccumulationMixin` into `RewardTrainer`."""


@dataclass
class AccumGRPOConfig(GRPOConfig, AccumTrainingArguments):
    """`trl.GRPOConfig` with hf_accum's fields. ``target_batch_size`` counts completions per optimizer step (prompts x
    num_generations), one generation batch per step. ``loss_normalization`` follows ``loss_type`` when unset:
    "tokens" for dapo (the default), cispo and vespo; "samples" (completions) for grpo, sapo, luspo and dr_grpo;
    bnpo, whose loss depends on the cut, is refused (hf_accum/integrations/trl/grpo.py)."""

    loss_normalization: str | None = None
    gradient_checkpointing: bool | None = field(default=None, metadata=_FLAG_METADATA)

    def __post_init__(self):
        if self.loss_normalization is None:
            self.loss_normalization = normalization_for(self.loss_type)
        problem = grpo_refusal(self, self.loss_normalization) if self.loss_type == "bnpo" else None
        if problem:  # before any setup: the one line names dapo
            raise ValueError(problem)
        if self.target_batch_size and self.num_generations and self.target_batch_size % self.num_generations:
            raise ValueError(
                f"target_batch_size={self.target_batch_size} completions is not a multiple of num_generations="
                f"{self.num_generations}: a generation batch holds whole groups of one prompt's completions. Set "
                f"target_batch_size to a multiple of {self.num_generations}."
            )
        planned = self.auto_tune and self.target_batch_size and self.generation_batch_size is None
        # the tuner plans the layout (a micro-batch given is unused, as tune() says): GRPOConfig's derivation of the
        # generation batch from it must not refuse it; train() derives it from the plan (grpo.before_train)
        rows = self.num_generations if planned and (
            self.per_device_train_batch_size * self.gradient_accumulation_steps) % self.num_generations else None
        with rows_per_device(self, rows):
            super().__post_init__()
        problem = grpo_refusal(self, self.loss_normalization)
        if problem:
            raise ValueError(problem)


class AccumGRPOTrainer(_TRLAccumulation, GRPOTrainer):
    """`trl.GRPOTrainer` + hf_accum: pass an `AccumGRPOConfig`. Each optimizer step generates and scores one
    generation batch (TRL's own generation, rewards and advantages over the whole batch), then trains on it in
    forwards of whole completion rows, of whatever size memory allows, the loss normalized over the whole generation
    batch exactly for every loss type but bnpo (refused): uneven cuts and out-of-memory re-runs give the same step
    as one pass over the batch. As for any class mixing `AccumulationMixin` into `GRPOTrainer` (hf_accum/integrations/trl/grpo.py)."""


# With TRL's fused head, SFTTrainer.compute_loss reads no logits: resolve_fused_loss must not count it (or ours) as a
# user override. Older TRL reads the logits for its token accuracy: hf_accum's fused loss stays off there.
AccumSFTTrainer._fused_compute_loss_classes = (SFTTrainer, AccumSFTTrainer) if trl_internals.trl_fuses_lm_head() else ()

__all__ = ["TRL_TRAINERS", "AccumDPOConfig", "AccumDPOTrainer", "AccumGRPOConfig", "AccumGRPOTrainer",
           "AccumRewardConfig", "AccumRewardTrainer",
           "AccumSFTConfig", "AccumSFTTrainer", "AccumulationMixin", "mixed_into"]
