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
import dataclasses
import inspect
import logging
import math
import os
import weakref

import torch
from transformers import Trainer, TrainerCallback

from . import _compat, checkpointing, dpo_sft, finite_grads, router_aux, tuning
from .accumulation_check import AccumulationCheck, run_accumulation_check
from .args import AccumTrainingArguments, explicit_batch_settings, resolve_nonfinite_limit
from .checkpoints import check_resume
from .deepspeed_batch import batch_contradiction
from .engine_probe import probe_through_engine
from .eval_batch import plan_eval_batch
from .evaluation import EvalLoss
from .fused_loss import with_fused_loss
from .loss import LabelSpec, label_spec
from .plan import Plan, divisors, plan_for_micro
from .plan_store import PLAN_FILE, save_plan
from .preemption import EXIT_PREEMPTED, TORCHRUN_GRACE_S, Preempted, StopRequest
from .preflight import check_output_dir_writable, check_training_data
from .protocol import Local, Policy, StopTraining, TorchDistributed, WindowProtocol
from .token_budget import TokenBudget
from .units import detect_unit, make_cutter
from .window import WindowEngine

logger = logging.getLogger(__name__)


class AccumulationMixin:
    """The overrides, as a mixin so other `Trainer` subclasses get them too (e.g. TRL's `SFTTrainer`:
    `class AccumSFTTrainer(AccumulationMixin, SFTTrainer)`). Must come before the Trainer class in the bases.

    Subclasses declare what one unit of their batches is (`batch_unit`: None detects rows or padding-free
    sequences from the batch; "pairs" for [chosen; rejected] preference batches) and whether their
    `compute_loss` runs collectives (TRL gathers metrics there), which rules out skipping forwards on one rank.
    Mixed into a TRL trainer, both come from the TRL class (`hf_accum.trl.TRL_TRAINERS`: DPOTrainer's batches are
    pairs, ...), and a TRL trainer whose batches hf_accum cannot cut exactly (GRPO's generation groups, ...) is
    refused at construction.
    """

    batch_unit: str | None = None
    resume_command: str | None = None  # how a stopped run is continued, where not from Python (`hf-accum train`)
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
        self.plan: Plan | None = None
        self._plan_given = False  # self.plan only records the sizes as given (auto_tune off): never stored
        self.probe_result = None
        self._plan_key: dict | None = None
        self._engine: WindowEngine | None = None
        self._pending_probe: tuning.Prepared | None = None  # DeepSpeed: probed through the engine, in the loop
        self._whole_windows: bool | None = None  # how the applied plan is loaded (`_loads_windows`)
        self._probing = False
        self._post_checked = False
        self._forwarded_tokens = 0  # by the current loaded batch's forwards (see floating_point_ops)
        self._nonfinite_streak = 0
        self._eval_loss: EvalLoss | None = None  # the evaluation being run (evaluation_loop)
        self._eval_cap: int | None = None  # the most units per evaluation forward known to fit, after an OOM
        self._eval_said: set[str] = set()
        self._eval_batch_planned = False  # auto_eval_batch_size: measured (or taken from a stored plan)
        self._budget_bytes: int | None = None  # the memory budget tune() resolved
        self._stop_request = StopRequest()
        self._refuse_unsupported_setups()
        self._skips_nonfinite = getattr(self.args, "max_nonfinite_steps", None) is not None
        if _compat.sharded_at_load(self.model) and not self.args.save_only_model:
            # transformers cannot checkpoint this model's optimizer state (see `_compat.sharded_at_load`); the
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
        _compat.refuse_silent_engine_fallback(self)
        checkpointing.check_request(self.model, self.args)
        if self._trl is not None and self._normalization != "model":
            base, mixed = self._trl
            problem = mixed.check(self) if mixed.check else None
            if problem:
                raise ValueError(f"{type(self).__name__} (hf_accum over {base}): {problem}")
        if hasattr(self.args, "max_nonfinite_steps"):
            limit, line = resolve_nonfinite_limit(self.args.max_nonfinite_steps, _compat.engine_steps_in_backward(self))
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
    def _normalization(self) -> str:
        # plain TrainingArguments: "tokens"; a plain TRL config: what its trainer's loss is a mean over
        trl = getattr(self, "_trl", None)
        return getattr(self.args, "loss_normalization", trl[1].normalization if trl else "tokens")

    # --- the window ---------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._pending_probe is not None and batch_samples:
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
        loaded = _compat.main_input_tokens(self, inputs)
        return flos * self._forwarded_tokens / loaded if self._forwarded_tokens and loaded else flos

    def _track_num_input_tokens(self, inputs):
        """``include_num_input_tokens_seen="all"`` counts the tokens forwarded (see `floating_point_ops`);
        "non_padding" counts the loaded batch's real tokens, as the Trainer does, the same in either mode."""
        if self.args.include_num_input_tokens_seen == "all" and self._forwarded_tokens:
            _compat.add_input_tokens_seen(self, self._forwarded_tokens)
        else:
            super()._track_num_input_tokens(inputs)

    def _skip_step(self, model) -> None:
        """A non-finite window loss on some rank: every rank drops the window's gradients (None, not zero: zero
        gradients still move AdamW's moments and weights); `_StepControl` stops after too many in a row."""
        model.zero_grad(set_to_none=True)
        self._nonfinite_streak += 1
        logger.warning("hf_accum: the loss or gradients of the window of optimizer step %d are not finite; that step "
                       "is skipped (gradients dropped; %d in a row)", self.state.global_step + 1, self._nonfinite_streak)

    def _gradients_finite(self):
        return finite_grads.gradients_finite(self.model.parameters())

    def _window_engine(self, batch) -> WindowEngine:
        if self._engine is None:
            self._engine = self._build_engine(batch, self.accelerator.num_processes)
        return self._engine

    def _build_engine(self, batch, world: int) -> WindowEngine:
        cutter = make_cutter(self.batch_unit or detect_unit(batch), self._label_spec())
        collective = TorchDistributed(world, self.args.device) if world > 1 else Local()
        policy = _compat.window_policy(self, self.collectives_in_compute_loss)
        engine = WindowEngine(cutter, self._normalization, WindowProtocol(collective, policy),
                              shrink=_weakly(self._shrink), reset=_weakly(self._zero_grad),
                              shrink_tokens=_weakly(self._shrink_tokens), device=self.args.device)
        engine.token_budget = _token_budget(self.plan)
        engine.cut_units = self._plan_cut(self.plan)
        engine.stop_requested = self._stop_request.__bool__
        if self._skips_nonfinite and self.accelerator.scaler is None:  # fp16 AMP: its scaler skips overflows itself
            engine.gradients_finite = _weakly(self._gradients_finite)
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
        scale, undo = share, 1
        if _compat.trainer_divides_by_accumulation(self, local_for_loss):
            undo = _compat.window_length(self)
            scale = share * undo  # pre-compensate training_step's division
        sync = contextlib.nullcontext() if final else self._no_gradient_sync(model)
        with sync, _compat.engine_boundary(self, final), self._loss_scaled(scale, final, undo) as raw:
            returned = super().training_step(model, inputs, local_for_loss)
        self._forwarded_tokens += _compat.main_input_tokens(self, inputs)
        if not self._post_checked:
            self._check_post_processing(returned, raw, share)
        return returned

    def _no_gradient_sync(self, model):
        # FSDP2 applied at load time is no accelerate wrapper: its switch is on the model itself.
        return _compat.no_gradient_sync(model) if _compat.is_fsdp2(model) else self.accelerator.no_sync(model)

    @contextlib.contextmanager
    def _loss_scaled(self, scale, final: bool, undo=1):
        """The one place the class's `compute_loss` (a user's override included) is wrapped, for one step: its
        loss is multiplied by ``scale``; the window's final forward runs through the engine so that every rank
        agrees before the gradient-synchronizing backward. A TRL MoE router loss is taken out and added back as
        its mean over the window's forwards (router_aux.py; ``undo`` pre-compensates training_step's division)."""
        original = self.compute_loss
        raw: list[torch.Tensor] = []

        def compute_loss(model, inputs, *args, **kwargs):
            with router_aux.taken_out(self, model) as captured, dpo_sft.reweighted(self, inputs, scale / undo):
                if final:
                    out, keep = self._engine.final_forward(lambda b, *a, **k: original(model, b, *a, **k), inputs,
                                                           *args, **kwargs)
                else:
                    out, keep = original(model, inputs, *args, **kwargs), 1.0
            loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
            raw.append(loss.detach())
            loss = loss * scale.to(loss.device, loss.dtype)
            term = router_aux.term(self, captured, self._engine.forwards())
            if term is not None:
                raw.append(term.detach())  # the expected returned value gains it (_check_post_processing)
                loss = loss + term.to(loss.dtype) * undo
            loss = loss * keep
            return (loss, *rest) if rest is not None else loss

        self.compute_loss = compute_loss
        try:
            yield raw
        finally:
            del self.compute_loss

    def _check_post_processing(self, returned, raw, share) -> None:
        # What training_step backpropagated must be the chunk's exact share of the window loss; otherwise
        # transformers changed its rule and `_compat` needs updating. Checked once: it costs a device sync.
        self._post_checked = True
        if not raw:
            return
        expected = float(raw[0] * share.to(raw[0].device, raw[0].dtype) + sum(raw[1:]))
        got = float(returned)
        if not math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-12) and math.isfinite(expected):
            raise RuntimeError(
                f"hf_accum: transformers' training_step rescaled the loss ({got} != {expected}); this transformers "
                "version post-processes the loss differently from what hf_accum._compat expects. Please report it; "
                "set loss_normalization='model' meanwhile."
            )

    # --- out-of-memory recovery ---------------------------------------------------------------------------------
    def _shrink(self, units: int | None) -> int:
        """The engine's next cut after an OOM: one more forward per window (loaded whole), or the next smaller
        micro-batch dividing the per-rank target (micro-batches loaded as given), applied as the plan in force
        (the effective batch and the step count are kept)."""
        self._refuse_rerun_under_deepspeed()
        plan = self._smaller_plan(units)
        if plan is None:
            raise RuntimeError(
                "hf_accum: out of memory at micro-batch 1, so no smaller micro-batch can keep "
                f"target_batch_size. Checkpoints in {self.args.output_dir} are intact. To fit: enable "
                "gradient_checkpointing, train LoRA adapters, load the base model in 4-bit, shorten sequences, "
                "or free GPU memory held by other processes; then resume from the last checkpoint."
            )
        logger.warning("hf_accum: out of memory at step %d; re-running this accumulation window with %s",
                       self.state.global_step, plan.describe())
        self.apply_plan(plan, in_training_loop=True)
        return plan.micro_batch_size

    def _shrink_tokens(self, budget: TokenBudget) -> TokenBudget:
        """micro_batching="tokens": after an OOM, three quarters of the token budget (same samples, same windows)."""
        self._refuse_rerun_under_deepspeed()
        longest = self._engine.longest_loaded_unit()
        smaller = budget.scaled(0.75)
        if smaller.rows(longest) < 1:
            raise RuntimeError(
                f"hf_accum: out of memory with a token budget of {budget}, and a smaller one cannot hold this window's "
                f"longest example ({longest} tokens). Checkpoints in {self.args.output_dir} are intact. To fit: "
                "enable gradient_checkpointing, train LoRA adapters, shorten sequences, or free memory; then resume."
            )
        plan = dataclasses.replace(self.plan, token_budget=smaller.tokens, token_model=smaller.model)
        logger.warning("hf_accum: out of memory at step %d; re-running this accumulation window with %s",
                       self.state.global_step, plan.describe())
        self.apply_plan(plan, in_training_loop=True)
        return smaller

    def _refuse_rerun_under_deepspeed(self) -> None:
        """Re-running a window needs its gradients cleared; DeepSpeed ZeRO reduces each backward's gradients into its
        own partitions, which `zero_grad` does not clear (and steps inside the final backward). So under DeepSpeed an
        out-of-memory error stops every rank, one process included, with the plan to restart with."""
        if _compat.engine_steps_in_backward(self):
            raise StopTraining("out of memory under DeepSpeed, whose engine already holds this window's reduced "
                               "gradients in its own partitions (they cannot be cleared to re-run the window)")

    def _smaller_plan(self, units: int | None = None) -> Plan | None:
        world = self._engine.world if self._engine is not None else self.accelerator.num_processes
        if self._loads_windows() and self.plan is not None:
            current = units or self.plan.micro_batch_size
            if current <= 1:
                return None
            return self._on_engine(self._keeping_level(plan_for_micro(self.plan.target_batch_size, world, current - 1)))
        current = units or self.args.per_device_train_batch_size
        target = getattr(self.args, "target_batch_size", None) or (
            self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * world
        )
        per_rank = target // world
        smaller = [d for d in divisors(per_rank) if d < current]
        if not smaller:
            return None
        return self._on_engine(self._keeping_level(Plan(smaller[-1], per_rank // smaller[-1], world, target)))

    def _keeping_level(self, plan: Plan) -> Plan:
        """A smaller plan after an OOM: the model keeps its checkpointing level, so the plan says so."""
        if self.plan is None or self.plan.checkpointed_layers is None:
            return plan
        return dataclasses.replace(plan, checkpointed_layers=self.plan.checkpointed_layers,
                                   num_layers=self.plan.num_layers)

    def _loads_windows(self) -> bool:
        """Each rank loads its whole window and the engine cuts it (the plan's near-equal forwards, or a token
        budget): whenever hf_accum plans; micro-batches are loaded as given only when the user set them. Fixed
        when a plan is applied (a recipe turns auto_tune off once it has planned)."""
        return self._whole_windows if self._whole_windows is not None else self._args_load_windows()

    def _args_load_windows(self) -> bool:
        return bool(getattr(self.args, "tunes", False)) or getattr(self.args, "micro_batching", "samples") == "tokens"

    def _plan_cut(self, plan: Plan | None) -> int | None:
        """The engine's units per forward for ``plan`` (None: each loaded batch is one forward, or a token budget
        cuts it)."""
        if plan is None or plan.token_budget is not None or not self._loads_windows():
            return None
        return plan.micro_batch_size

    def _on_engine(self, plan: Plan) -> Plan:
        """The plan, naming the sharded engine that runs it (DeepSpeed and its ZeRO stage)."""
        label = _compat.engine_label(self)
        return plan if label is None else dataclasses.replace(plan, engine=label)

    def _stop_message(self, reason: str) -> str:
        if self._probing:
            return f"hf_accum: {reason}. Every rank stops before the first optimizer step; no weights were changed."
        plan = self._smaller_plan(self._engine.cut_units if self._engine else None)
        if _compat.sharded_at_load(self.model):
            how = "Restart (a new run: a model sharded at load time cannot be resumed) with"
        elif self.args.save_only_model:
            how = "Restart (a new run from the last checkpoint's weights: save_only_model=True saves no optimizer state) with"
        else:
            how = "Restart (resume from the last checkpoint) with"
        if plan is None:
            setting = "a smaller model footprint"
        elif self._loads_windows():
            setting = f"probe_max_micro_batch={plan.micro_batch_size} ({plan.describe()})"
        else:
            setting = (f"per_device_train_batch_size={plan.micro_batch_size} and gradient_accumulation_steps="
                       f"{plan.gradient_accumulation_steps} ({plan.describe()})")
        return (
            f"hf_accum: {reason}; this cannot be recovered without risking diverging or hanging ranks, so every "
            f"rank stops. Checkpoints in {self.args.output_dir} are intact. {how} {setting}."
        )

    # --- planning ---------------------------------------------------------------------------------------------
    def apply_plan(self, plan: Plan, *, in_training_loop: bool = False) -> None:
        """The one writer of the micro-batch / accumulation state (as transformers' `_update_auto_batch_size`).

        Before training it sets the batch size the dataloader is built with. Inside the loop the dataloader and
        the loop's window length are fixed, so the engine cuts each loaded batch into chunks of the new size
        (same samples per window: the effective batch and step count are kept); here the plan is only recorded.
        """
        plan = self._on_engine(plan)
        into_deepspeed = not in_training_loop and _compat.deepspeed_stage(self) is not None
        if into_deepspeed:
            self._check_deepspeed_batch(plan)  # before anything changes
        if self._engine is not None:
            self._engine.token_budget = _token_budget(plan)
        if not in_training_loop:
            # loaded whole, each window is cut by the engine (`_plan_cut`); else transformers loads the micro-batches
            self._whole_windows = self._args_load_windows()
            micro, accumulation = ((plan.window, 1) if self._whole_windows
                                   else (plan.micro_batch_size, plan.gradient_accumulation_steps))
            self.args.per_device_train_batch_size = micro
            self.args.gradient_accumulation_steps = accumulation
            _compat.set_train_batch_size(self, micro)
            if self._engine is not None:
                self._engine.cut_units = self._plan_cut(plan)
            if into_deepspeed and self.args.deepspeed is not None:
                # the engine, built in train(), gets the plan: "auto" batch fields filled from these arguments
                _compat.fill_deepspeed_config(self)
        if plan.eval_batch_size is not None:  # a stored plan: measured at an earlier run's first evaluation
            self.args.per_device_eval_batch_size = plan.eval_batch_size
            self._eval_batch_planned = True
        if plan.checkpointed_layers is not None and not in_training_loop:
            checkpointing.apply_chosen(self.model, plan.checkpointed_layers, self.args)  # a stored plan's k too
        self.plan, self._plan_given = plan, False
        if in_training_loop and self.args.should_save:  # tune() saved the plan it applies, with its probe
            save_plan(self.args.output_dir, self._plan_key or {}, plan, None)

    def _check_deepspeed_batch(self, plan: Plan) -> None:
        """Before the DeepSpeed engine is built, its batch fields must be able to take the plan: an explicit value
        that contradicts it is refused, naming the field. (A live engine's fields are never changed: a plan changed
        inside the loop is applied by cutting loaded batches, the engine stepping once per window.) Launched with
        accelerate's DeepSpeed plugin instead of `deepspeed=`, its already-filled values must equal the plan."""
        user = self.args.deepspeed
        config = _compat.deepspeed_user_config(user) if user is not None else _compat.deepspeed_batch_config(self)
        problem = batch_contradiction(config, plan.micro_batch_size, plan.gradient_accumulation_steps,
                                      plan.world_size, plan.describe())
        if problem:
            raise ValueError(problem)

    @_compat.trl_metrics_kept
    @with_fused_loss
    def tune(self) -> Plan:
        """Measure (or reuse the stored plan), plan micro x accumulation x world = target, apply it."""
        with self._refusal_leaves_output_dir():
            if not self._checked_before_probe:  # train() checked already
                self._check_before_probe()
            return self._tune()

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

    def _tune(self) -> Plan:
        prepared = tuning.prepare(self)
        self._budget_bytes = prepared.budget
        if prepared.stored is None and _compat.deepspeed_stage(self) is not None:
            raise ValueError(
                "tune() cannot probe a DeepSpeed run before train(): ZeRO partitions the model when train() builds "
                "the engine, and the probe measures through that engine. Call train() (it probes at the first "
                "window), or set auto_tune=False with per_device_train_batch_size x gradient_accumulation_steps x "
                f"world size = target_batch_size={self.args.target_batch_size}."
            )
        plan, self.probe_result, self._plan_key = tuning.tune(self, prepared)
        self.apply_plan(plan)
        return plan

    def _tune_deepspeed(self) -> None:
        """Under DeepSpeed a stored plan is applied as usual; otherwise each rank loads its whole window (micro = the
        per-rank target, accumulation 1: the engine is built for that) and the probe runs through the engine at
        the first window (`_probe_through_engine`), whose plan then cuts every loaded window."""
        prepared = tuning.prepare(self)
        if prepared.stored is not None:
            plan, self.probe_result, self._plan_key = tuning.tune(self, prepared)
            self.apply_plan(plan)
            return
        world = self.args.world_size
        self.apply_plan(Plan(self.args.target_batch_size // world, 1, world, self.args.target_batch_size))
        self.plan = None  # the loading plan is not a plan: the probe has not run
        self._pending_probe = prepared

    @_compat.trl_metrics_kept
    def _probe_through_engine(self, batch) -> None:
        prepared, self._pending_probe = self._pending_probe, None
        world = self.accelerator.num_processes
        collective = TorchDistributed(world, self.args.device) if world > 1 else Local()

        def train_step(inputs):  # one real step through the engine, which steps its optimizer at the boundary
            with _compat.engine_boundary(self, True), _compat.window_length_set(self, 1):
                super(AccumulationMixin, self).training_step(_compat.deepspeed_engine(self), inputs)

        def probe(make, length, max_micro=self.args.probe_max_micro_batch):
            return probe_through_engine(self, collective=collective, train_step=train_step, make_batch=make,
                                        seq_len=length, budget_bytes=prepared.budget, meter=prepared.meter,
                                        budget_names=" or ".join(tuning.BUDGET_NAMES), max_micro_batch=max_micro,
                                        log=logger.info)

        self._probing = True  # left set when the probe stops the run: the stop message says so
        plan, self.probe_result, self._plan_key = tuning.tune(self, prepared, probe)
        self._probing = False
        self.plan = plan = self._on_engine(plan)
        engine = self._window_engine(batch)
        engine.token_budget = _token_budget(plan)
        engine.cut_units = self._plan_cut(plan)  # each loaded window, cut into the plan's forwards
        # the engine loads whole windows, as the Trainer does; hf_accum sets its boundary per forward
        _compat.set_deepspeed_batch(self, plan.window, 1)

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
            self._probing = False
            self._checked_before_probe = False
            downgraded = self._engine is not None and self._engine.cut_units is not None
            if self._engine is not None:
                self._engine.end()
            if downgraded and self.plan is not None:
                self.apply_plan(self.plan)  # the downgraded plan becomes the configured one for later calls

    def _check_and_plan(self, resume_from_checkpoint):
        """Every check first (`_check_before_probe`, the checkpoint to resume), then the plan: probed, stored or
        given. Returns the checkpoint to resume (True resolved)."""
        self._refuse_unresumable(resume_from_checkpoint)
        if self._plan_given:  # recorded by an earlier train(): the arguments may have changed since
            self.plan, self._plan_given = None, False
        self._check_before_probe()
        resume_from_checkpoint, stored = self._check_output_dir(resume_from_checkpoint)
        self._checked_before_probe = True
        checkpointing.apply_requested(self.model, self.args)  # an explicit k (True: Trainer.train sets it)
        if getattr(self.args, "tunes", False) and self.plan is None and _compat.deepspeed_stage(self) is not None:
            self._tune_deepspeed()
        elif getattr(self.args, "tunes", False) and self.plan is None:  # a tune() before train() counts
            self.tune()
        elif getattr(self.args, "micro_batching", "samples") == "tokens" and self.plan is None:
            self.apply_plan(self._given_token_plan())
        elif stored is not None and resume_from_checkpoint:
            self.apply_plan(stored)  # the plan in force when the checkpoint was written (maybe downgraded)
        if self.plan is None:  # the sizes as given are the plan in force: trainer.plan.describe() works
            world = self.accelerator.num_processes
            micro, accumulation = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
            self.plan, self._plan_given = Plan(micro, accumulation, world, micro * accumulation * world), True
        return resume_from_checkpoint

    def _refuse_unresumable(self, resume_from_checkpoint) -> None:
        if resume_from_checkpoint and _compat.sharded_at_load(self.model):
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
        if _compat.sharded_at_load(self.model):
            return (f"This run cannot be resumed (its model was sharded at load time; transformers saves no optimizer "
                    f"state for it): start a new run from the weights in {where} "
                    "(from_pretrained(CHECKPOINT, distributed_config=...)); the optimizer and schedule start over.")
        if self.args.save_only_model:
            return (f"This run cannot be resumed (save_only_model=True: its checkpoints hold no optimizer or scheduler "
                    f"state): start a new run from the weights in {where} (from_pretrained(CHECKPOINT)); the "
                    "optimizer and schedule start over.")
        if self.resume_command:
            return f"Resume with: {self.resume_command}"
        return (f"Resume with trainer.train(resume_from_checkpoint={where!r}) (or resume_from_checkpoint=True for "
                f"the newest checkpoint in {self.args.output_dir}).")

    def _given_token_plan(self) -> Plan:
        """micro_batching="tokens" with auto_tune off: the window as given, loaded whole, cut by the given budget."""
        args, world = self.args, self.accelerator.num_processes
        per_rank = args.per_device_train_batch_size * args.gradient_accumulation_steps
        return Plan(per_rank, 1, world, per_rank * world, token_budget=args.max_tokens_per_forward)

    def _saved_weights_said(self) -> str:
        # Non-finite steps are never taken, but an optimizer can make NaN from finite gradients (AdamW's eps
        # underflows to 0 in fp16 weights): the claim is checked, not assumed.
        if finite_grads.weights_finite(self.model.parameters()):
            return "finite weights"
        return ("weights that are NOT finite (an optimizer step with finite gradients made them NaN/inf, e.g. AdamW "
                "on fp16 weights; load them in float32 or bf16)")

    def _raise_if_stopped(self) -> None:
        """After the Trainer's loop ended early on our request: say where the checkpoint is and how to resume."""
        where = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        limit = getattr(self.args, "max_nonfinite_steps", None)
        if limit is not None and self._nonfinite_streak > limit:
            raise RuntimeError(
                f"hf_accum: {self._nonfinite_streak} optimizer steps in a row had a non-finite loss or gradients "
                f"(NaN/inf), more than max_nonfinite_steps={limit}; training stopped at step "
                f"{self.state.global_step} with {self._saved_weights_said()} saved to {where}. Lower the learning "
                "rate, check the data around these steps, or enable bf16 instead of fp16; then go on from that "
                "checkpoint. " + self._resume_advice(where)
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
        return check_resume(self.args, resume_from_checkpoint, deepspeed=_compat.deepspeed_enabled(self))

    # --- self-check -------------------------------------------------------------------------------------------
    @_compat.trl_metrics_kept
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
        world = self.accelerator.num_processes
        tally.finish(output.metrics, metric_key_prefix, TorchDistributed(world, self.args.device) if world > 1 else Local())
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        step = super().prediction_step
        if self._eval_loss is None:  # called outside evaluation_loop
            return step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return self._eval_loss.step(lambda batch, loss_only: step(model, batch, loss_only, ignore_keys=ignore_keys),
                                    inputs, prediction_loss_only)

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        # Measured on the trainer's own eval set (a TRL trainer prepares a dataset passed here only in its evaluate).
        if self._plans_eval_batch() and self.eval_dataset is not None and (eval_dataset is None
                                                                            or isinstance(eval_dataset, str)):
            self._plan_eval_batch(eval_dataset)
        return super().evaluate(eval_dataset, *args, **kwargs)

    def _plans_eval_batch(self) -> bool:
        auto = getattr(self.args, "auto_eval_batch_size", None)
        asked, auto = auto, getattr(self.args, "tunes", False) if auto is None else auto
        if not auto or self._eval_batch_planned:
            return False
        if _compat.deepspeed_enabled(self) or (self.accelerator.num_processes > 1 and _compat.window_policy(
                self, self.collectives_in_compute_loss) is not Policy.RERUN):
            # Each rank searches on its own: not where forwards run collectives (FSDP, ZeRO, TRL's metrics).
            self._eval_batch_planned = True
            (logger.warning if asked else logger.info)(
                "hf_accum: auto_eval_batch_size is not measured where evaluation forwards run collectives (FSDP, "
                "DeepSpeed, TRL's metric gathering on several ranks); per_device_eval_batch_size stays %d.",
                self.args.per_device_eval_batch_size)
            return False
        return True

    @_compat.trl_metrics_kept  # the measuring steps are not evaluation: TRL's eval metrics must not average them
    def _plan_eval_batch(self, dataset) -> None:
        """`auto_eval_batch_size`: measure evaluation steps now, with what training keeps resident (eval_batch.py)."""
        self._eval_batch_planned = True
        choice = plan_eval_batch(self, dataset, budget=self._budget_bytes,
                                 run=lambda model, batch, loss_only: super(AccumulationMixin, self).prediction_step(
                                     model, batch, loss_only))
        if choice is None:
            return
        self.args.per_device_eval_batch_size = choice.batch_size
        if self.args.eval_accumulation_steps is None and choice.accumulation_steps is not None:
            self.args.eval_accumulation_steps = choice.accumulation_steps
        if self.plan is not None:
            self.plan = dataclasses.replace(self.plan, eval_batch_size=choice.batch_size)
            if self.args.should_save and getattr(self.args, "target_batch_size", None) and not self._plan_given:
                probe = self.probe_result.to_dict() if self.probe_result is not None else None
                save_plan(self.args.output_dir, self._plan_key or {}, self.plan, probe)

    def _new_eval_loss(self) -> EvalLoss:
        try:
            labels = self._label_spec() if self._normalization != "model" else LabelSpec()
        except ValueError as exc:  # a model whose loss hf_accum cannot count: transformers' value, said once
            labels = str(exc)
        # An OOM re-run forwards more on one rank: not where forwards run collectives (FSDP, ZeRO, TRL's metrics).
        can_split = (self.accelerator.num_processes == 1
                     or _compat.window_policy(self, self.collectives_in_compute_loss) is Policy.RERUN)
        return EvalLoss(self, self._normalization, self.batch_unit, labels, can_split=can_split, cap=self._eval_cap,
                        said=self._eval_said)


def _trl_base(cls: type, args) -> tuple[str, object] | None:
    """The TRL trainer ``cls`` mixes into and what hf_accum does over it (`hf_accum.trl.mixed_into`); raises, naming
    what to use, where hf_accum cannot cut its batches exactly."""
    if not any(c.__module__.split(".")[0] == "trl" and issubclass(c, Trainer) for c in cls.__mro__):
        return None
    from .trl import mixed_into

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


def _token_budget(plan: Plan | None) -> TokenBudget | None:
    if plan is None or plan.token_budget is None:
        return None
    return TokenBudget(plan.token_budget, plan.token_model,
                       plan.token_model.get("forward_tokens") if plan.token_model else None)


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
        plan = None if trainer._plan_given else trainer.plan  # a recorded given plan: as before, from the args
        if plan is None and getattr(args, "target_batch_size", None):
            plan = trainer._on_engine(Plan(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                           args.world_size, args.target_batch_size))
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if plan is not None and args.should_save and os.path.isdir(folder):
            save_plan(folder, trainer._plan_key or {}, plan, None)


class AccumTrainer(AccumulationMixin, Trainer):
    """Drop-in `transformers.Trainer`; pass `AccumTrainingArguments` to choose how the loss is normalized,
    and a `target_batch_size` to have the micro-batch and accumulation planned from measured memory.

    With plain `TrainingArguments` it behaves as `loss_normalization="tokens"` and never auto-tunes.
    """


__all__ = ["AccumTrainer", "AccumulationMixin", "PLAN_FILE"]
