"""`AccumTrainer`: transformers' `Trainer` with exact loss normalization over the accumulation window, a
memory-planned micro-batch, and recovery from out-of-memory errors mid-training.

It keeps the Trainer's own loop and per-window batch fetching; the overrides are thin and call `super()`:
- `get_batch_samples` counts the window's labels (all ranks) once per optimizer step and keeps its batches;
- `training_step` scales each micro-batch's loss to its exact share of the window loss (see `loss.py`); on an
  OOM it moves to a smaller micro-batch and re-runs the window from its start (see `_recover`);
- `train` plans (probe or stored plan), optionally checks accumulation, then calls `super().train()`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os

import torch
from transformers import Trainer, TrainerCallback

from . import _compat
from .accumulation_check import AccumulationCheck, run_accumulation_check
from .batches import sliver, split
from .fused_loss import with_fused_loss
from .loss import Window, count_items, loss_shifts_labels
from .oom import free_memory, is_oom
from .plan import Plan, divisors
from .plan_store import PLAN_FILE, load_stored_plan, save_plan
from .tuning import tune

logger = logging.getLogger(__name__)


class _Restart(Exception):
    """Some rank ran out of memory in this window: every rank re-runs it with a smaller micro-batch."""


class AccumulationMixin:
    """The overrides, as a mixin so other `Trainer` subclasses get them too (e.g. TRL's `SFTTrainer`:
    `class AccumSFTTrainer(AccumulationMixin, SFTTrainer)`). Must come before the Trainer class in the bases."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._normalization = getattr(self.args, "loss_normalization", "tokens")
        self._shift = loss_shifts_labels(self.model)
        self._window: Window | None = None
        self._window_world: int | None = None  # forced data-parallel size (1 inside check_accumulation)
        self._window_batches: list = []
        self._micro_index = 0
        self._window_returned: list[torch.Tensor] = []
        self._oom_pending = False
        self._drain_then_restart = False
        self._split_micro: int | None = None  # micro-batch in force after an OOM, below the dataloader's
        self._plan_key: dict | None = None
        self._post_checked = False
        self.plan: Plan | None = None
        self.probe_result = None
        self.add_callback(_PlanInCheckpoints(self))
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
            self._window_batches = batch_samples
            self._micro_index = 0
            self._window_returned = []
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
        if not self._window_batches:  # called outside the Trainer loop: the window is this one batch
            self._window = self._count_window([inputs], self.args.device)
            return self._exact_step(model, inputs)
        last = self._micro_index == len(self._window_batches) - 1
        self._micro_index += 1
        try:
            returned = self._micro_step(model, inputs, last)
        except _Restart:
            returned = self._recover(model)
        self._window_returned.append(returned)
        return returned

    def _micro_step(self, model, inputs, last: bool):
        """One micro-batch of the loop, as chunks of the micro-batch in force; raises `_Restart` (all ranks
        together, at the window's last micro-batch) when any rank ran out of memory in this window."""
        chunks = split(inputs, self._split_micro) if self._split_micro else [inputs]
        total = None
        for j, chunk in enumerate(chunks):
            final = last and j == len(chunks) - 1
            part = self._guarded_step(model, chunk, final)
            total = part if total is None else total + part
        return total

    def _guarded_step(self, model, inputs, final: bool):
        if final and self._agree_on_restart(self._oom_pending):
            # Agreed before the final forward: under DDP that forward runs collectives (buffer broadcast) that a
            # rank skipping it would mismatch.
            raise _Restart()
        if self._oom_pending:  # this window is re-run anyway: skip to the final step, where ranks agree
            return torch.zeros((), device=self.args.device)
        sync = contextlib.nullcontext() if final else self.accelerator.no_sync(model)
        oom = False
        try:
            with sync:
                returned = self._exact_step(model, inputs, final=final)
            if self._drain_then_restart:  # the aborted synchronized iteration is complete on every rank
                self._drain_then_restart = False
                raise _Restart()
            return returned
        except _Restart:
            raise
        except Exception as exc:
            if not is_oom(exc):
                raise
            oom = True
        finally:
            if oom:
                free_memory()
        # Out of memory outside the final forward (handled in _scaled_compute_loss).
        if not final:
            self._oom_pending = True
            return torch.zeros((), device=self.args.device)
        if self._world() > 1:
            # The final backward synchronizes gradients: the other ranks are inside that all-reduce, so a
            # coordinated restart is impossible. Stop with the plan to restart with (the process exit ends
            # the collective on the other ranks, no hang).
            plan = self._smaller_plan()
            raise RuntimeError(
                "hf_accum: out of memory inside the gradient-synchronizing backward pass; this cannot be recovered "
                "without risking diverging ranks. Checkpoints in output_dir are intact. Restart (resume from the "
                "last checkpoint) with "
                + (f"per_device_train_batch_size={plan.micro_batch_size} and gradient_accumulation_steps="
                   f"{plan.gradient_accumulation_steps} ({plan.describe()})" if plan else "a smaller model footprint")
                + "."
            )
        raise _Restart()

    def _exact_step(self, model, inputs, final: bool = False):
        local = count_items(inputs, self._normalization, self._shift)
        # Every loss path divides by num_items_in_batch (or its own count, the same number): a micro-batch mean.
        # Clamped so an all-masked micro-batch gives 0 instead of 0/0 on paths that divide by it.
        local_for_loss = local.clamp(min=1).to(self.args.device)
        share = self._window.scale(local)
        scale = share
        if _compat.trainer_divides_by_accumulation(self, local_for_loss):
            # Pre-compensate the division training_step is about to apply.
            scale = share * getattr(self, "current_gradient_accumulation_steps", 1)
        with self._scaled_compute_loss(scale, agree=final) as raw:
            returned = super().training_step(model, inputs, local_for_loss)
        if not self._post_checked:
            self._check_post_processing(returned, raw, share)
        return returned

    @contextlib.contextmanager
    def _scaled_compute_loss(self, scale, agree: bool = False):
        """Shadow `compute_loss` (the class's, including a user's override) for one step, scaling its loss.

        ``agree``: this is the window's final forward; before its (gradient-synchronizing) backward all ranks
        agree on whether any of them ran out of memory, so that either all restart the window or none does.
        """
        original = self.compute_loss
        raw: list[torch.Tensor] = []

        def compute_loss(*args, **kwargs):
            # Taken before the call: transformers' compute_loss pops "labels" out of the dict it is given.
            small = sliver(args[1]) if agree and self._world() > 1 else None
            try:
                out = original(*args, **kwargs)
            except Exception as exc:
                if not (agree and is_oom(exc)):
                    raise
                oom = True
            else:
                oom = False
            if oom:
                free_memory()
                self._agree_on_restart(True)  # exactly one exchange per rank here, as the others do
                if self._world() == 1:
                    raise _Restart()
                # The other ranks finished a gradient-synchronizing DDP forward and their reducers now expect
                # its backward: complete that iteration here too, on a one-sample, two-token sliver (the
                # window's gradients are cleared before the re-run anyway), then restart.
                out = original(args[0], small, *args[2:], **kwargs)
                self._drain_then_restart = True
            elif agree and self._agree_on_restart(False):
                if self._world() == 1:
                    raise _Restart()
                self._drain_then_restart = True
            loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
            raw.append(loss.detach())
            loss = loss * scale.to(loss.device, loss.dtype)
            if self._drain_then_restart:
                loss = loss * 0
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

    # --- out-of-memory recovery ---------------------------------------------------------------------------------
    def _world(self) -> int:
        return self._window.world if self._window is not None else self.accelerator.num_processes

    def _agree_on_restart(self, mine: bool) -> bool:
        """All-reduce (max) of "I ran out of memory in this window". Every rank reaches it at the same two points
        of each window: just before and just after the final forward (two tiny collectives per optimizer step)."""
        if self._world() == 1:
            return mine
        t = torch.tensor(float(mine), device=self.args.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def _smaller_plan(self) -> Plan | None:
        current = self._split_micro or self.args.per_device_train_batch_size
        world = self._world()
        target = getattr(self.args, "target_batch_size", None) or (
            self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * world
        )
        per_rank = target // world
        smaller = [d for d in divisors(per_rank) if d < current]
        if not smaller:
            return None
        return Plan(smaller[-1], per_rank // smaller[-1], world, target)

    def _recover(self, model):
        """Re-run the interrupted window from its start, with gradients cleared, at the next smaller micro-batch
        dividing the per-rank target. Returns what makes the loop's running loss equal the re-run window's."""
        while True:
            self._oom_pending = False
            plan = self._smaller_plan()
            if plan is None:
                raise RuntimeError(
                    "hf_accum: out of memory at micro-batch 1, so no smaller micro-batch can keep "
                    f"target_batch_size. Checkpoints in {self.args.output_dir} are intact. To fit: enable "
                    "gradient_checkpointing, train LoRA adapters, load the base model in 4-bit, shorten sequences, "
                    "or free GPU memory held by other processes; then resume from the last checkpoint."
                )
            logger.warning(
                "hf_accum: out of memory at step %d; re-running this accumulation window with %s",
                self.state.global_step, plan.describe(),
            )
            self.apply_plan(plan, in_training_loop=True)
            model.zero_grad(set_to_none=True)
            free_memory()
            try:
                parts = [
                    self._micro_step(model, b, i == len(self._window_batches) - 1)
                    for i, b in enumerate(self._window_batches)
                ]
            except _Restart:
                continue
            total = sum(parts[1:], parts[0])
            already = sum(self._window_returned, torch.zeros_like(total))
            return total - already

    # --- planning ---------------------------------------------------------------------------------------------
    def apply_plan(self, plan: Plan, *, in_training_loop: bool = False) -> None:
        """The one writer of the micro-batch / accumulation state (as transformers' `_update_auto_batch_size`).

        Before training it sets the batch size the dataloader is built with. Inside the loop the dataloader and
        the loop's window length are fixed, so a smaller plan is applied by cutting each loaded micro-batch
        into chunks of the new size (same samples per window: the effective batch and step count are kept).
        """
        if in_training_loop:
            self._split_micro = plan.micro_batch_size
        else:
            self.args.per_device_train_batch_size = plan.micro_batch_size
            self.args.gradient_accumulation_steps = plan.gradient_accumulation_steps
            self._train_batch_size = plan.micro_batch_size  # what get_train_dataloader and train() read
            self._split_micro = None
        self.plan = plan
        if in_training_loop and self.args.should_save:  # tune() saved the plan it applies, with its probe
            save_plan(self.args.output_dir, self._plan_key or {}, plan, None)

    @with_fused_loss
    def tune(self) -> Plan:
        """Measure (or reuse the stored plan), plan micro x accumulation x world = target, apply it."""
        plan, self.probe_result, self._plan_key = tune(self)
        self.apply_plan(plan)
        return plan

    @with_fused_loss
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        try:
            stored = self._check_output_dir(resume_from_checkpoint)
            if getattr(self.args, "tunes", False) and self.plan is None:  # a tune() before train() counts
                self.tune()
            elif stored is not None and resume_from_checkpoint:
                self.apply_plan(stored)  # the plan in force when the checkpoint was written (maybe downgraded)
            if getattr(self.args, "check_accumulation", False):
                self.check_accumulation()
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._window = None
            self._window_batches = []
            if self._split_micro and self.plan is not None:
                self.apply_plan(self.plan)  # the downgraded plan becomes the configured one for later calls

    def _check_output_dir(self, resume_from_checkpoint) -> Plan | None:
        """A run's checkpoints belong to its target batch: resuming or continuing with another is an error.
        Returns the plan stored with the checkpoint resumed from (or the output_dir's last one)."""
        from transformers.trainer_utils import get_last_checkpoint

        if isinstance(resume_from_checkpoint, str):
            where = resume_from_checkpoint
        else:
            where = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        stored = load_stored_plan(where) if where else None
        target = getattr(self.args, "target_batch_size", None) or self.args.per_device_train_batch_size * (
            self.args.gradient_accumulation_steps * self.args.world_size)
        if stored is not None and stored.target_batch_size != target:
            raise ValueError(
                f"{where} holds a run trained with target_batch_size={stored.target_batch_size}, but "
                f"target_batch_size={target} now. Resume with target_batch_size={stored.target_batch_size}, or "
                "start the new run in another output_dir."
            )
        return stored

    # --- self-check -------------------------------------------------------------------------------------------
    def check_accumulation(self, num_micro_batches: int | None = None, tolerance: float | None = None) -> AccumulationCheck:
        """Compare the gradient of k micro-batches with one pass over the same samples on the real model and data.

        See `accumulation_check.run_accumulation_check`; every gradient, weight and RNG state is restored.
        """
        if tolerance is None:
            tolerance = getattr(self.args, "check_accumulation_tolerance", None)
        return run_accumulation_check(self, num_micro_batches=num_micro_batches, tolerance=tolerance)

    # --- evaluation ---------------------------------------------------------------------------------------------
    def evaluate(self, *args, **kwargs):
        """An OOM in evaluation lowers the eval batch size only; the training plan is never touched."""
        while True:
            try:
                return super().evaluate(*args, **kwargs)
            except Exception as exc:
                if not is_oom(exc) or self.args.per_device_eval_batch_size <= 1:
                    raise
            free_memory()
            old = self.args.per_device_eval_batch_size
            self.args.per_device_eval_batch_size = max(1, old // 2)
            logger.warning("hf_accum: out of memory in evaluation; per_device_eval_batch_size %d -> %d",
                           old, self.args.per_device_eval_batch_size)


class _PlanInCheckpoints(TrainerCallback):
    """Each checkpoint carries the plan in force, so a resume knows which target batch it belongs to."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        plan = self.trainer.plan
        if plan is None and getattr(args, "target_batch_size", None):
            plan = Plan(args.per_device_train_batch_size, args.gradient_accumulation_steps, args.world_size,
                        args.target_batch_size)
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if plan is not None and args.should_save and os.path.isdir(folder):
            save_plan(folder, self.trainer._plan_key or {}, plan, None)


class AccumTrainer(AccumulationMixin, Trainer):
    """Drop-in `transformers.Trainer`; pass `AccumTrainingArguments` to choose how the loss is normalized,
    and a `target_batch_size` to have the micro-batch and accumulation planned from measured memory.

    With plain `TrainingArguments` it behaves as `loss_normalization="tokens"` and never auto-tunes.
    """


__all__ = ["AccumTrainer", "AccumulationMixin", "PLAN_FILE"]
