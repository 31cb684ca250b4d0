"""`AccumTrainer`: transformers' `Trainer` with exact loss normalization over the accumulation window.

It keeps the Trainer's own loop and per-window batch fetching; the overrides are thin and call `super()`:
- `get_batch_samples` counts the window's labels (all ranks) once per optimizer step;
- `training_step` scales each micro-batch's loss to its exact share of the window loss (see `loss.py`);
- `train` optionally runs `check_accumulation` first.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from transformers import Trainer

from . import _compat
from .accumulation_check import AccumulationCheck, run_accumulation_check
from .loss import Window, count_items, loss_shifts_labels
from .plan import Plan
from .tuning import tune

logger = logging.getLogger(__name__)


class AccumulationMixin:
    """The overrides, as a mixin so other `Trainer` subclasses get them too (e.g. TRL's `SFTTrainer`:
    `class AccumSFTTrainer(AccumulationMixin, SFTTrainer)`). Must come before the Trainer class in the bases."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._normalization = getattr(self.args, "loss_normalization", "tokens")
        self._shift = loss_shifts_labels(self.model)
        self._window: Window | None = None
        self._window_world: int | None = None  # forced data-parallel size (1 inside check_accumulation)
        self._post_checked = False
        self.plan: Plan | None = None
        self.probe_result = None
        if self._normalization == "model":
            return
        if self.args.n_gpu > 1:
            raise ValueError(
                f"loss_normalization={self._normalization!r} does not support torch.nn.DataParallel "
                f"(n_gpu={self.args.n_gpu}). Launch one process per GPU with `torchrun` or `accelerate launch` "
                "(DDP/FSDP), or set loss_normalization='model'."
            )
        if self.args.average_tokens_across_devices:
            # We count across ranks ourselves; leaving transformers' flag on would multiply the loss twice.
            logger.info(
                "hf_accum: loss_normalization=%r normalizes over all ranks exactly; overriding "
                "average_tokens_across_devices=True -> False so transformers does not rescale the loss again.",
                self._normalization,
            )
            self.args.average_tokens_across_devices = False

    # --- per-window state ---------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._normalization != "model" and batch_samples:
            self._window = self._count_window(batch_samples, device)
        return batch_samples, num_items_in_batch

    def _count_window(self, batches, device) -> Window:
        local = sum(count_items(b, self._normalization, self._shift).to(device) for b in batches)
        world = self._window_world or self.accelerator.num_processes
        total = self.accelerator.reduce(local, reduction="sum") if world > 1 else local
        if int(total) == 0:
            raise ValueError(
                "An accumulation window has no counted labels (every label is -100 after the causal shift), so "
                f"loss_normalization={self._normalization!r} cannot normalize it. Check that the collator masks only "
                "prompt/padding tokens, drop examples without targets, or set loss_normalization='model'."
            )
        return Window(items=total, world=world)

    # --- the loss ---------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._normalization == "model":
            return super().training_step(model, inputs, num_items_in_batch)
        if self._window is None:  # called outside the Trainer loop (e.g. by a user): the window is this batch
            self._window = self._count_window([inputs], self.args.device)
        local = count_items(inputs, self._normalization, self._shift)
        # Every loss path divides by num_items_in_batch (or its own count, the same number): a micro-batch mean.
        # Clamped so an all-masked micro-batch gives 0 instead of 0/0 on paths that divide by it.
        local_for_loss = local.clamp(min=1).to(self.args.device)
        share = self._window.scale(local)
        scale = share
        if _compat.trainer_divides_by_accumulation(self, local_for_loss):
            # Pre-compensate the division training_step is about to apply.
            scale = share * getattr(self, "current_gradient_accumulation_steps", 1)
        with self._scaled_compute_loss(scale) as raw:
            returned = super().training_step(model, inputs, local_for_loss)
        if not self._post_checked:
            self._check_post_processing(returned, raw, share)
        return returned

    @contextlib.contextmanager
    def _scaled_compute_loss(self, scale):
        """Shadow `compute_loss` (the class's, including a user's override) for one step, scaling its loss."""
        original = self.compute_loss
        raw: list[torch.Tensor] = []

        def compute_loss(*args, **kwargs):
            out = original(*args, **kwargs)
            loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
            raw.append(loss.detach())
            loss = loss * scale.to(loss.device, loss.dtype)
            return (loss, *rest) if rest is not None else loss

        self.compute_loss = compute_loss
        try:
            yield raw
        finally:
            del self.compute_loss

    def _check_post_processing(self, returned, raw, share) -> None:
        # What training_step backpropagated must be the micro-batch's exact share of the window loss; otherwise
        # transformers changed its rule and `_compat` needs updating. Checked once: it costs a device sync.
        self._post_checked = True
        if not raw:
            return
        expected = float(raw[0] * share.to(raw[0].device, raw[0].dtype))
        got = float(returned)
        if not math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-12) and math.isfinite(expected):
            raise RuntimeError(
                f"hf_accum: transformers' training_step rescaled the loss ({got} != {expected}); this transformers "
                "version post-processes the loss differently from what hf_accum._compat expects. Please report it; "
                "set loss_normalization='model' meanwhile."
            )

    # --- self-check -------------------------------------------------------------------------------------------
    def check_accumulation(self, num_micro_batches: int | None = None, tolerance: float | None = None) -> AccumulationCheck:
        """Compare the gradient of k micro-batches with one pass over the same samples on the real model and data.

        See `accumulation_check.run_accumulation_check`; every gradient, weight and RNG state is restored.
        """
        if tolerance is None:
            tolerance = getattr(self.args, "check_accumulation_tolerance", None)
        return run_accumulation_check(self, num_micro_batches=num_micro_batches, tolerance=tolerance)

    # --- planning ---------------------------------------------------------------------------------------------
    def apply_plan(self, plan: Plan) -> None:
        """The one writer of the micro-batch / accumulation state (as transformers' `_update_auto_batch_size`)."""
        self.args.per_device_train_batch_size = plan.micro_batch_size
        self.args.gradient_accumulation_steps = plan.gradient_accumulation_steps
        self._train_batch_size = plan.micro_batch_size  # what get_train_dataloader and train() read
        self.plan = plan

    def tune(self) -> Plan:
        """Measure (or reuse the stored plan), plan micro x accumulation x world = target, apply it."""
        plan, self.probe_result = tune(self)
        self.apply_plan(plan)
        return plan

    def train(self, *args, **kwargs):
        try:
            if getattr(self.args, "tunes", False):
                self.tune()
            if getattr(self.args, "check_accumulation", False):
                self.check_accumulation()
            return super().train(*args, **kwargs)
        finally:
            self._window = None



class AccumTrainer(AccumulationMixin, Trainer):
    """Drop-in `transformers.Trainer`; pass `AccumTrainingArguments` to choose how the loss is normalized,
    and a `target_batch_size` to have the micro-batch and accumulation planned from measured memory.

    With plain `TrainingArguments` it behaves as `loss_normalization="tokens"` and never auto-tunes.
    """
