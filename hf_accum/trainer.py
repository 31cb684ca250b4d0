"""`AccumTrainer`: transformers' `Trainer` with exact loss normalization over the accumulation window, a
memory-planned micro-batch, and recovery from out-of-memory errors mid-training.

`AccumulationMixin` is a thin adapter: the window engine (`window.py`, which knows no Trainer) cuts and runs
each window and owns the rank-agreement protocol (`protocol.py`); the overrides below only hand it the Trainer's
pieces, each calling `super()`:
- `get_batch_samples` begins the window (its count on every rank); under DeepSpeed with auto_tune, the first
  one first runs the probe through the engine `train()` built (`_probe_through_engine`, `engine_probe.py`);
- `training_step` runs one loaded batch through the engine, which calls back `_chunk_step` per chunk;
- `_chunk_step` is the Trainer's own `training_step` on one chunk, its loss scaled by the chunk's exact share
  (the one place the user's `compute_loss` is wrapped: `_loss_scaled`);
- `train` plans (probe or stored plan), optionally checks accumulation, then calls `super().train()`;
- `evaluation_loop` / `prediction_step` hand each evaluation batch to `evaluation.EvalLoss` (an exact eval_loss in
  training's unit, and OOM re-runs of the failed batch alone); `evaluate` first plans the eval batch once
  (`auto_eval_batch_size`, eval_batch.py).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import os
import weakref

import torch
from transformers import Trainer, TrainerCallback

from . import checkpointing
from .accumulation_check import AccumulationCheck, run_accumulation_check
from .args import AccumTrainingArguments, explicit_batch_settings, resolve_nonfinite_limit
from .checkpoints import check_resume
from .compat import deepspeed_integration, parallel, trainer_internals, trl_internals
from .evaluation import EvalLoss
from .fused_loss import with_fused_loss
from .loss import LabelSpec, label_spec
from .planning.plan import Plan
from .planning.planner import Planner
from .planning.store import PLAN_FILE
from .preemption import EXIT_PREEMPTED, TORCHRUN_GRACE_S, Preempted, StopRequest
from .preflight import check_output_dir_writable, check_training_data
from .protocol import Local, Policy, StopTraining, TorchDistributed, WindowProtocol
from .units import detect_unit, make_cutter
from .window import WindowEngine

logger = logging.getLogger(__name__)


class AccumulationMixin:
    """The overrides, as a mixin so other `Trainer` subclasses get them too (e.g. TRL's `SFTTrainer`:
    `class AccumSFTTrainer(AccumulationMixin, SFTTrainer)`). Must come before the Trainer class in the bases.

    Subclasses declare what one unit of their batches is (`batch_unit`: None detects rows or padding-free
    sequences from the batch; "pairs" for [chosen; rejected] preference batches) and whether their
    `compute_loss` runs collectives (TRL gathers metrics there), which rules out skipping forwards on one rank.
    Mixed into a TRL trainer, both come from the TRL class (`hf_accum.trl_support.TRL_TRAINERS`: DPOTrainer's batches are
    pairs, ...), and a TRL trainer whose batches hf_accum cannot cut exactly (GRPO's generation groups, ...) is
    refused at construction.
    """

    batch_unit: str | None = None
    collectives_in_compute_loss: bool = False

    def __init__(self, *args, **kwargs):
        # The caller's arguments object is never written to: the tuner and OOM recovery change our copy.
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        if bound.arguments.get("args") is not None:
            bound.arguments["args"] = copy.copy(bound.arguments["args"])
        self._trl = _trl_base(type(self), bound.arguments.get("args"))  # before TRL tokenizes the data
        if self._trl is not None:
            self.batch_unit = self.batch_unit or self._trl[1].unit
            self.collectives_in_compute_loss = True  # every TRL trainer gathers metrics in compute_loss
        given_dir = getattr(bound.arguments.get("args"), "output_dir", None)
        existed = given_dir is None or os.path.exists(given_dir)
        super().__init__(*bound.args, **bound.kwargs)
        # transformers creates output_dir here; a run refused before training removes it again while still empty
        self._made_output_dir = given_dir if not existed else None
        # the batch settings the user gave, before any plan replaces them on our copy (tuning warns they are unused)
        self._given_batch = explicit_batch_settings(self.args) if isinstance(self.args, AccumTrainingArguments) else {}
        self._checked_before_probe = False
        self._planner = Planner(self)  # the one writer of the plan and of every batch setting it implies
        self._engine: WindowEngine | None = None
        self._post_checked = False
        self._forwarded_tokens = 0  # by the current loaded batch's forwards (see floating_point_ops)
        self._nonfinite_streak = 0
        self._eval_loss: EvalLoss | None = None  # the evaluation being run (evaluation_loop)
        self._eval_cap: int | None = None  # the most units per evaluation forward known to fit, after an OOM
        self._eval_said: set[str] = set()
        self._stop_request = StopRequest()
        self._refuse_unsupported_setups()
        self._skips_nonfinite = getattr(self.args, "max_nonfinite_steps", None) is not None
        if parallel.sharded_at_load(self.model) and not self.args.save_only_model:
            # transformers cannot checkpoint this model's optimizer state (see `parallel.sharded_at_load`); the
            # checkpoints hf_accum itself writes when it stops (a signal, non-finite losses) then hold the weights
            # and the plan, not an optimizer file that could never be loaded. The stop messages say so.
            self.args.save_only_model = True
        if isinstance(self.args, AccumTrainingArguments) and self._normalization != "model":
            self.add_callback(_StepControl(self))
        if getattr(self.args, "target_batch_size", None):  # only runs with a target have a plan to keep
            self.add_callback(_PlanInCheckpoints(self))
        if self._normalization != "model" and self.args.average_tokens_across_devices and self.args.world_size > 1:
            # We count across ranks ourselves; transformers' flag would gather and rescale the loss a second time.
            logger.info(
                "hf_accum: loss_normalization=%r normalizes over all ranks exactly; average_tokens_across_devices "
                "is off for this trainer (the arguments you passed are unchanged).", self._normalization,
            )
            self.args.average_tokens_across_devices = False

    def _refuse_unsupported_setups(self) -> None:
        """Every setup hf_accum cannot run exactly fails here, at construction, naming what to set."""
        parallel.refuse_silent_engine_fallback(self)
        checkpointing.check_request(self.model, self.args)
        if self._trl is not None and self._normalization != "model":
            base, mixed = self._trl
            problem = mixed.check(self) if mixed.check else None
            if problem:
                raise ValueError(f"{type(self).__name__} (hf_accum over {base}): {problem}")
        if hasattr(self.args, "max_nonfinite_steps"):
            limit, line = resolve_nonfinite_limit(self.args.max_nonfinite_steps, deepspeed_integration.engine_steps_in_backward(self))
            self.args.max_nonfinite_steps = limit  # our copy: "auto" resolved for this engine
            if line and self._normalization != "model":
                (logger.warning if limit is None else logger.info)(line)  # DeepSpeed's: nothing is skipped for you
        if self._normalization != "model" and self.args.n_gpu > 1:
            raise ValueError(
                f"loss_normalization={self._normalization!r} does not support torch.nn.DataParallel "
                f"(n_gpu={self.args.n_gpu}). Launch one process per GPU with `torchrun` or `accelerate launch` "
                "(DDP/FSDP), or set loss_normalization='model'."
            )

    @property
    def plan(self) -> Plan | None:
        """The plan in force (read-only: the planner writes it)."""
        return self._planner.plan

    @property
    def probe_result(self):
        """What the probe measured for the plan in force (None: a stored or given plan)."""
        return self._planner.probe_result

    @property
    def planner(self) -> Planner:
        return self._planner

    @property
    def _normalization(self) -> str:
        # plain TrainingArguments: "tokens"; a plain TRL config: what its trainer's loss is a mean over
        trl = getattr(self, "_trl", None)
        return getattr(self.args, "loss_normalization", trl[1].normalization if trl else "tokens")

    # --- the window ---------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._planner.pending_probe is not None and batch_samples:
            self._probe_through_engine(batch_samples[0])
        if self._normalization != "model" and batch_samples:
            self._window_engine(batch_samples[0]).begin(batch_samples)
        return batch_samples, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._normalization == "model":
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self._window_engine(inputs)
        if not engine.active:  # called outside the Trainer loop: the window is this one batch
            engine.begin([inputs])
        self._forwarded_tokens = 0
        returned = engine.step(inputs, lambda chunk, final: self._chunk_step(model, chunk, final))
        if not engine.active and engine.outcome.skip and self._skips_nonfinite:
            self._skip_step(model)
        return returned

    # --- what the Trainer counts per loaded batch: the tokens its forwards really held ----------------------------
    def floating_point_ops(self, inputs):
        """transformers' estimate (6 x parameters x tokens of the main input), over the tokens forwarded for this
        loaded batch: a cut pads each chunk only to its own longest row, and an OOM re-run forwards again."""
        flos = super().floating_point_ops(inputs)
        loaded = trainer_internals.main_input_tokens(self, inputs)
        return flos * self._forwarded_tokens / loaded if self._forwarded_tokens and loaded else flos

    def _track_num_input_tokens(self, inputs):
        """``include_num_input_tokens_seen="all"`` counts the tokens forwarded (see `floating_point_ops`);
        "non_padding" counts the loaded batch's real tokens, as the Trainer does, the same in either mode."""
        if self.args.include_num_input_tokens_seen == "all" and self._forwarded_tokens:
            trainer_internals.add_input_tokens_seen(self, self._forwarded_tokens)
        else:
            super()._track_num_input_tokens(inputs)

    def _skip_step(self, model) -> None:
        """A non-finite window loss on some rank: every rank drops the window's gradients (None, not zero: zero
        gradients still move AdamW's moments and weights); `_StepControl` stops after too many in a row."""
        model.zero_grad(set_to_none=True)
        self._nonfinite_streak += 1
        logger.warning("hf_accum: the loss of the window of optimizer step %d is not finite; that step is skipped "
                       "(gradients dropped; %d in a row)", self.state.global_step + 1, self._nonfinite_streak)

    def _window_engine(self, batch) -> WindowEngine:
        if self._engine is None:
            self._engine = self._build_engine(batch, self.accelerator.num_processes)
        return self._engine

    def _build_engine(self, batch, world: int) -> WindowEngine:
        cutter = make_cutter(self.batch_unit or detect_unit(batch), self._label_spec())
        collective = TorchDistributed(world, self.args.device) if world > 1 else Local()
        policy = parallel.window_policy(self, self.collectives_in_compute_loss)
        engine = WindowEngine(cutter, self._normalization, WindowProtocol(collective, policy),
                              shrink=_weakly(self._planner.after_oom), reset=_weakly(self._zero_grad),
                              shrink_tokens=_weakly(self._planner.after_oom_tokens), device=self.args.device)
        self._planner.configure(engine)
        engine.stop_requested = self._stop_request.__bool__
        return engine

    def _zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def _label_spec(self) -> LabelSpec:
        custom = self.compute_loss_func is not None or type(self).compute_loss is not Trainer.compute_loss
        return label_spec(self.model, self.args.label_names, custom_loss=custom)

    # --- one chunk: the Trainer's own training_step, its loss scaled to the chunk's exact share -------------------
    def _chunk_step(self, model, inputs, final: bool):
        engine = self._engine
        local = engine.cutter.count(inputs, engine.mode)
        # Every loss path divides by num_items_in_batch (or its own count, the same number): a chunk mean.
        # Clamped so an all-masked chunk gives 0 instead of 0/0 on paths that divide by it.
        local_for_loss = local.clamp(min=1).to(self.args.device)
        share = engine.share(local)
        scale = share
        if trainer_internals.trainer_divides_by_accumulation(self, local_for_loss):
            scale = share * trainer_internals.window_length(self)  # pre-compensate training_step's division
        sync = contextlib.nullcontext() if final else self._no_gradient_sync(model)
        with sync, deepspeed_integration.engine_boundary(self, final), self._loss_scaled(scale, final) as raw:
            returned = super().training_step(model, inputs, local_for_loss)
        self._forwarded_tokens += trainer_internals.main_input_tokens(self, inputs)
        if not self._post_checked:
            self._check_post_processing(returned, raw, share)
        return returned

    def _no_gradient_sync(self, model):
        # FSDP2 applied at load time is no accelerate wrapper: its switch is on the model itself.
        return parallel.no_gradient_sync(model) if parallel.is_fsdp2(model) else self.accelerator.no_sync(model)

    @contextlib.contextmanager
    def _loss_scaled(self, scale, final: bool):
        """The one place the class's `compute_loss` (a user's override included) is wrapped, for one step: its
        loss is multiplied by ``scale``; the window's final forward runs through the engine so that every rank
        agrees before the gradient-synchronizing backward."""
        original = self.compute_loss
        raw: list[torch.Tensor] = []

        def compute_loss(model, inputs, *args, **kwargs):
            if final:
                out, keep = self._engine.final_forward(lambda b, *a, **k: original(model, b, *a, **k), inputs,
                                                       *args, **kwargs)
            else:
                out, keep = original(model, inputs, *args, **kwargs), 1.0
            loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
            raw.append(loss.detach())
            loss = loss * scale.to(loss.device, loss.dtype) * keep
            return (loss, *rest) if rest is not None else loss

        self.compute_loss = compute_loss
        try:
            yield raw
        finally:
            del self.compute_loss

    def _check_post_processing(self, returned, raw, share) -> None:
        # What training_step backpropagated must be the chunk's exact share of the window loss; otherwise
        # transformers changed its rule and `compat.trainer_internals` needs updating. Checked once: it costs a device sync.
        self._post_checked = True
        if not raw:
            return
        expected = float(raw[0] * share.to(raw[0].device, raw[0].dtype))
        got = float(returned)
        if not math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-12) and math.isfinite(expected):
            raise RuntimeError(
                f"hf_accum: transformers' training_step rescaled the loss ({got} != {expected}); this transformers "
                "version post-processes the loss differently from what hf_accum.compat.trainer_internals expects. Please report it; "
                "set loss_normalization='model' meanwhile."
            )

    def _stop_message(self, reason: str) -> str:
        if self._planner.probing:
            return f"hf_accum: {reason}. Every rank stops before the first optimizer step; no weights were changed."
        if parallel.sharded_at_load(self.model):
            how = "Restart (a new run: a model sharded at load time cannot be resumed) with"
        elif self.args.save_only_model:
            how = "Restart (a new run from the last checkpoint's weights: save_only_model=True saves no optimizer state) with"
        else:
            how = "Restart (resume from the last checkpoint) with"
        setting = self._planner.restart_setting()
        return (
            f"hf_accum: {reason}; this cannot be recovered without risking diverging or hanging ranks, so every "
            f"rank stops. Checkpoints in {self.args.output_dir} are intact. {how} {setting}."
        )

    # --- planning ---------------------------------------------------------------------------------------------
    def apply_plan(self, plan: Plan, *, in_training_loop: bool = False) -> None:
        """Put ``plan`` in force (`Planner.apply`: the one writer of the batch settings it implies)."""
        self._planner.apply(plan, in_training_loop=in_training_loop)

    @trl_internals.trl_metrics_kept
    @with_fused_loss
    def tune(self) -> Plan:
        """Measure (or reuse the stored plan), plan micro x accumulation x world = target, apply it."""
        with self._refusal_leaves_output_dir():
            if not self._checked_before_probe:  # train() checked already
                self._check_before_probe()
            return self._planner.tune()

    def _check_before_probe(self) -> None:
        """Everything the arguments, the data and the model's config can tell, before any model work and before
        anything is written to output_dir (`preflight.py`)."""
        if self._normalization != "model":
            self._label_spec()  # refuses a model whose loss hf_accum cannot drive exactly
        check_training_data(self)
        if getattr(self.args, "tunes", False) and self.args.should_save:
            check_output_dir_writable(self.args.output_dir)

    @contextlib.contextmanager
    def _refusal_leaves_output_dir(self):
        """A run refused before training leaves output_dir as it found it: the empty folder transformers' __init__
        made is removed again (nothing else was written: the plan file comes after every check and the probe)."""
        try:
            yield
        except BaseException:
            made = self._made_output_dir
            if made is not None and self.args.should_save:  # one process per folder removes it
                with contextlib.suppress(OSError):  # gone already, or written to since: left as it is
                    os.rmdir(made)
            raise
        self._made_output_dir = None  # the run started: the folder is its own, and a later refusal keeps it

    @trl_internals.trl_metrics_kept
    def _probe_through_engine(self, batch) -> None:
        def train_step(inputs):  # one real step through the engine, which steps its optimizer at the boundary
            with deepspeed_integration.engine_boundary(self, True), trainer_internals.window_length_set(self, 1):
                super(AccumulationMixin, self).training_step(deepspeed_integration.deepspeed_engine(self), inputs)

        self._planner.probe_through_engine(self._window_engine(batch), train_step, self._collective())

    def _collective(self):
        world = self.accelerator.num_processes
        return TorchDistributed(world, self.args.device) if world > 1 else Local()

    @with_fused_loss
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        try:
            with self._refusal_leaves_output_dir():
                resume_from_checkpoint = self._check_and_plan(resume_from_checkpoint)
            if getattr(self.args, "check_accumulation", False):
                self.check_accumulation()
            handle = getattr(self.args, "handle_preemption", False) and self._normalization != "model"
            try:
                with self._stop_request.installed(handle):
                    output = super().train(resume_from_checkpoint, *args, **kwargs)
            except StopTraining as exc:
                raise StopTraining(self._stop_message(str(exc))) from None
            self._raise_if_stopped()
            return output
        finally:
            self._planner.probing = False
            self._checked_before_probe = False
            downgraded = self._engine is not None and self._engine.cut_units is not None
            if self._engine is not None:
                self._engine.end()
            if downgraded and self.plan is not None:
                self._planner.apply(self.plan)  # the downgraded plan becomes the configured one for later calls

    def _check_and_plan(self, resume_from_checkpoint):
        """Every check first (`_check_before_probe`, the checkpoint to resume), then the plan: probed, stored or
        given. Returns the checkpoint to resume (True resolved)."""
        self._refuse_unresumable(resume_from_checkpoint)
        self._check_before_probe()
        resume_from_checkpoint, stored = self._check_output_dir(resume_from_checkpoint)
        self._checked_before_probe = True
        checkpointing.apply_requested(self.model, self.args)  # an explicit k (True: Trainer.train sets it)
        self._planner.start(stored, resume_from_checkpoint)
        return resume_from_checkpoint

    def _refuse_unresumable(self, resume_from_checkpoint) -> None:
        if resume_from_checkpoint and parallel.sharded_at_load(self.model):
            raise ValueError(
                f"resume_from_checkpoint={resume_from_checkpoint!r} cannot resume exactly: the model was sharded at "
                "load time (distributed_config=...), and transformers checkpoints no optimizer state for such a "
                "model. Train without resume_from_checkpoint: to go on from a checkpoint's weights, load them with "
                "from_pretrained(CHECKPOINT, distributed_config=...) as a new run (optimizer and schedule start "
                "over); for an exact resume under FSDP2, use hf_accum.loop with torch.distributed.checkpoint "
                "(README, \"Scaling out\")."
            )

    def _resume_advice(self, where: str) -> str:
        """How to go on from the checkpoint ``where`` after a stop."""
        if parallel.sharded_at_load(self.model):
            return (f"This run cannot be resumed (its model was sharded at load time; transformers saves no optimizer "
                    f"state for it): start a new run from the weights in {where} "
                    "(from_pretrained(CHECKPOINT, distributed_config=...)); the optimizer and schedule start over.")
        if self.args.save_only_model:
            return (f"This run cannot be resumed (save_only_model=True: its checkpoints hold no optimizer or scheduler "
                    f"state): start a new run from the weights in {where} (from_pretrained(CHECKPOINT)); the "
                    "optimizer and schedule start over.")
        return (f"Resume with trainer.train(resume_from_checkpoint={where!r}) (or resume_from_checkpoint=True for "
                f"the newest checkpoint in {self.args.output_dir}).")

    def _raise_if_stopped(self) -> None:
        """After the Trainer's loop ended early on our request: say where the checkpoint is and how to resume."""
        where = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        limit = getattr(self.args, "max_nonfinite_steps", None)
        if limit is not None and self._nonfinite_streak > limit:
            raise RuntimeError(
                f"hf_accum: {self._nonfinite_streak} optimizer steps in a row had a non-finite loss (NaN/inf), "
                f"more than max_nonfinite_steps={limit}; training stopped at step {self.state.global_step} with "
                f"finite weights saved to {where}. Lower the learning rate, check the data around these steps, or "
                "enable bf16 instead of fp16; then go on from that checkpoint. " + self._resume_advice(where)
            )
        request = self._stop_request
        if self._engine is not None and self._engine.outcome.stop:
            took = request.seconds_since()
            late = (f" That took {took:.1f} s, longer than torchrun's {TORCHRUN_GRACE_S} s grace period: under a "
                    "launcher the processes may be killed before the checkpoint is complete; save more often."
                    if took > TORCHRUN_GRACE_S else f" ({took:.1f} s after the signal.)")
            message = (
                f"hf_accum: stopped by {request.signal_name or 'another rank'} after optimizer step "
                f"{self.state.global_step}; checkpoint saved to {where}.{late} {self._resume_advice(where)} "
                f"Exit code {EXIT_PREEMPTED}."
            )
            logger.warning(message)  # a SystemExit prints nothing by itself
            raise Preempted(message)

    def _check_output_dir(self, resume_from_checkpoint):
        """A run's checkpoints belong to its target batch (see `checkpoints.check_resume`). Returns the checkpoint
        to resume (True resolved to the newest complete one) and the plan stored with it."""
        return check_resume(self.args, resume_from_checkpoint, deepspeed=deepspeed_integration.deepspeed_enabled(self))

    # --- self-check -------------------------------------------------------------------------------------------
    @trl_internals.trl_metrics_kept
    def check_accumulation(self, num_micro_batches: int | None = None, tolerance: float | None = None) -> AccumulationCheck:
        """Compare the gradient of k micro-batches with one pass over the same samples on the real model and data.

        See `accumulation_check.run_accumulation_check`; every gradient, weight and RNG state is restored.
        """
        if tolerance is None:
            tolerance = getattr(self.args, "check_accumulation_tolerance", None)
        return run_accumulation_check(self, num_micro_batches=num_micro_batches, tolerance=tolerance)

    # --- evaluation: an exact eval_loss, OOM re-runs of the failed batch alone (evaluation.py) ---------------------
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._eval_loss = self._new_eval_loss()
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        finally:
            tally, self._eval_loss = self._eval_loss, None
        self._eval_cap = tally.cap
        tally.finish(output.metrics, metric_key_prefix, self._collective())
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        step = super().prediction_step
        if self._eval_loss is None:  # called outside evaluation_loop
            return step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return self._eval_loss.step(lambda batch, loss_only: step(model, batch, loss_only, ignore_keys=ignore_keys),
                                    inputs, prediction_loss_only)

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        # Measured on the trainer's own eval set (a TRL trainer prepares a dataset passed here only in its evaluate).
        if self._planner.wants_eval_batch(self.collectives_in_compute_loss) and self.eval_dataset is not None and (eval_dataset is None
                                                                            or isinstance(eval_dataset, str)):
            self._plan_eval_batch(eval_dataset)
        return super().evaluate(eval_dataset, *args, **kwargs)

    @trl_internals.trl_metrics_kept  # the measuring steps are not evaluation: TRL's eval metrics must not average them
    def _plan_eval_batch(self, dataset) -> None:
        """`auto_eval_batch_size`: measured with the Trainer's own prediction_step (`Planner.plan_eval_batch`)."""
        self._planner.plan_eval_batch(dataset, lambda model, batch, loss_only: super(
            AccumulationMixin, self).prediction_step(model, batch, loss_only))

    def _new_eval_loss(self) -> EvalLoss:
        try:
            labels = self._label_spec() if self._normalization != "model" else LabelSpec()
        except ValueError as exc:  # a model whose loss hf_accum cannot count: transformers' value, said once
            labels = str(exc)
        # An OOM re-run forwards more on one rank: not where forwards run collectives (FSDP, ZeRO, TRL's metrics).
        can_split = (self.accelerator.num_processes == 1
                     or parallel.window_policy(self, self.collectives_in_compute_loss) is Policy.RERUN)
        return EvalLoss(self, self._normalization, self.batch_unit, labels, can_split=can_split, cap=self._eval_cap,
                        said=self._eval_said)


def _trl_base(cls: type, args) -> tuple[str, object] | None:
    """The TRL trainer ``cls`` mixes into and what hf_accum does over it (`hf_accum.trl_support.mixed_into`); raises, naming
    what to use, where hf_accum cannot cut its batches exactly."""
    if not any(c.__module__.split(".")[0] == "trl" and issubclass(c, Trainer) for c in cls.__mro__):
        return None
    from .trl_support import mixed_into

    base, mixed = mixed_into(cls)
    if mixed.refusal and getattr(args, "loss_normalization", None) != "model":
        raise ValueError(f"{cls.__name__} mixes AccumulationMixin into {base}: {mixed.refusal}.")
    if cls.batch_unit is not None and mixed.unit is not None and cls.batch_unit != mixed.unit:
        raise ValueError(f"{cls.__name__} declares batch_unit={cls.batch_unit!r}, but {base} collates "
                         f"{mixed.unit}: set batch_unit={mixed.unit!r} (or leave it unset).")
    return base, mixed


class _StepControl(TrainerCallback):
    """Ends the Trainer's loop, with a checkpoint, after a step the ranks agreed to stop at (a signal) or after
    too many non-finite steps in a row. Holds the trainer weakly."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is None or trainer._engine is None:
            return
        outcome = trainer._engine.outcome
        if not outcome.skip:
            trainer._nonfinite_streak = 0
        too_many = args.max_nonfinite_steps is not None and trainer._nonfinite_streak > args.max_nonfinite_steps
        if outcome.stop or too_many:
            control.should_save = True
            control.should_training_stop = True


def _weakly(method):
    """A callable for `method` that does not keep its trainer alive (no cycle: `del trainer` frees the model)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class _PlanInCheckpoints(TrainerCallback):
    """Each checkpoint carries the plan in force, so a resume knows which target batch it belongs to. Holds the
    trainer weakly: a callback must not keep a deleted trainer (and its model's memory) alive."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_save(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is None:
            return
        planner = trainer.planner
        plan = planner.plan
        if plan is None and getattr(args, "target_batch_size", None):
            plan = planner.given_plan()
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if plan is not None and args.should_save and os.path.isdir(folder):
            planner.save(folder, probe=False, plan=plan)


class AccumTrainer(AccumulationMixin, Trainer):
    """Drop-in `transformers.Trainer`; pass `AccumTrainingArguments` to choose how the loss is normalized,
    and a `target_batch_size` to have the micro-batch and accumulation planned from measured memory.

    With plain `TrainingArguments` it behaves as `loss_normalization="tokens"` and never auto-tunes.
    """


__all__ = ["AccumTrainer", "AccumulationMixin", "PLAN_FILE"]
