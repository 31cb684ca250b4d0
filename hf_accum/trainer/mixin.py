"""`AccumTrainer`: transformers' `Trainer` with exact loss normalization over the accumulation window, a
memory-planned micro-batch, and recovery from out-of-memory errors mid-training.

`AccumulationMixin` is a thin adapter. It holds a `Planner` (planning/planner.py: the one writer of the plan and
of every batch setting it implies), a window engine (`window/engine.py`, which knows no Trainer: it cuts and runs each
window and owns the rank-agreement protocol, `window/protocol.py`) and the engine it runs on (`integrations/engines/`: one process,
DDP, FSDP or DeepSpeed behind one seam; it never asks which). The overrides below only hand them the Trainer's
pieces, each calling `super()`:
- `get_batch_samples` begins the window (its count on every rank); where the probe runs through the engine
  `train()` built (DeepSpeed) with auto_tune, the first one first runs it (`_probe_through_engine`);
- `training_step` runs one loaded batch through the engine, which calls back `_chunk_step` per chunk;
- `_chunk_step` is the Trainer's own `training_step` on one chunk, its loss scaled by the chunk's exact share
  (the one place the user's `compute_loss` is wrapped: `scaled_loss.loss_scaled`);
- `train` checks, has the planner plan (probe, stored or given plan), optionally checks accumulation, then calls
  `super().train()`; what a stopped run says is in `stopping.py`, what is refused at construction in
  `construction.py`;
- after each optimizer step, at each checkpoint and in the first log entry: `step_hooks.StepHooks`;
- in evaluation: `eval_hooks.EvaluationHooks` (an exact eval_loss in training's unit, OOM re-runs of the failed
  batch alone, the eval batch measured once).
"""

from __future__ import annotations

import copy
import inspect
import os
import weakref

from transformers import Trainer

from .. import levers
from ..args import AccumTrainingArguments
from ..compat import trainer_internals, trl_internals
from ..config.settings import Settings
from ..integrations import engines
from ..integrations.trl.adapter import NO_ADAPTER
from ..levers.kernels.fused_loss import with_fused_loss
from ..planning.planner import Planner
from ..planning.store import PLAN_FILE
from ..probing.plan import Plan
from ..window.engine import WindowEngine
from ..window.evaluation import EvalLoss
from ..window.loss import LabelSpec, label_spec
from ..window.protocol import Local, StopTraining, TorchDistributed, WindowProtocol
from ..window.units import detect_unit, make_cutter
from . import scaled_loss
from .checks import accumulation_check, construction
from .checks.accumulation_check import AccumulationCheck, run_accumulation_check
from .checks.preflight import check_model_computes_a_loss, check_output_dir_writable, check_training_data
from .eval_hooks import EvaluationHooks
from .resilience import finite_grads, stopping
from .resilience.checkpoints import check_resume
from .resilience.preemption import StopRequest
from .step_hooks import StepHooks


class AccumulationMixin(StepHooks, EvaluationHooks):
    """The overrides, as a mixin so other `Trainer` subclasses get them too (e.g. TRL's `SFTTrainer`:
    `class AccumSFTTrainer(AccumulationMixin, SFTTrainer)`). Must come before the Trainer class in the bases.

    Subclasses declare what one unit of their batches is (`batch_unit`: None detects rows or padding-free
    sequences from the batch; "pairs" for [chosen; rejected] preference batches) and whether their
    `compute_loss` runs collectives (TRL gathers metrics there), which rules out skipping forwards on one rank.
    Mixed into a TRL trainer, both come from the TRL class (`hf_accum.integrations.trl.support.TRL_TRAINERS`: DPOTrainer's batches are
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
        self._trl = construction.trl_base(type(self), bound.arguments.get("args"))  # before TRL tokenizes the data
        self._adapter = self._trl[1].adapter if self._trl is not None else NO_ADAPTER
        if self._trl is not None:
            self.batch_unit = self.batch_unit or self._trl[1].unit
            self.collectives_in_compute_loss = True  # every TRL trainer gathers metrics in compute_loss
        given_dir = getattr(bound.arguments.get("args"), "output_dir", None)
        existed = given_dir is None or os.path.exists(given_dir)
        super().__init__(*bound.args, **bound.kwargs)
        construction.keep_4bit_layers_unpacked(self)  # before any forward: an eval-mode one on CPU breaks QLoRA
        # transformers creates output_dir here; a run refused before training removes it again while still empty
        self._made_output_dir = given_dir if not existed else None
        # the batch settings the user gave, before any plan replaces them on our copy (tuning warns they are unused)
        self._given_batch = self.settings.explicit_batch() if isinstance(self.args, AccumTrainingArguments) else {}
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
        with stopping.refusal_leaves_output_dir(self, starts=False):  # a refused trainer leaves no folder either
            self._parallel = engines.select(self)  # the engine seam: DDP, FSDP, DeepSpeed or one process
            construction.refuse_unsupported_setups(self)
        self._skips_nonfinite = self._nonfinite_limit is not None
        construction.adjust_args_copy(self)
        # What happens after each optimizer step and at each checkpoint (`_maybe_log_save_evaluate`,
        # `_save_checkpoint` below): Trainer methods, not callbacks, so the user's callback list is the Trainer's.
        # Plain TrainingArguments: nothing of ours (no grow_back_steps, no max_nonfinite_steps).
        self._controls_steps = isinstance(self.args, AccumTrainingArguments) and self._normalization != "model"
        self._plans_in_checkpoints = bool(self.settings.target_batch_size)  # only runs with a target have a plan
        self._window_ended = False  # a window ran since `_after_step` last acted
        self._figures_logged = False  # the plan's figures went with this run's first log entry
        self._check_figures: dict[str, float] = {}  # check_accumulation's figure, for the same entry

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
    def engine(self) -> engines.Engine:
        """The engine this trainer runs on, behind one seam (`hf_accum/integrations/engines/`; not the window engine)."""
        return self._parallel

    @property
    def settings(self) -> Settings:
        """hf_accum's settings on this trainer's arguments (plain TrainingArguments: hf_accum's defaults)."""
        return Settings(self.args)

    @property
    def _normalization(self) -> str:
        # plain TrainingArguments: "tokens"; a plain TRL config: what its trainer's loss is a mean over
        trl = getattr(self, "_trl", None)
        return self.settings.loss_normalization or (trl[1].normalization_of(self.args) if trl else "tokens")

    # --- the window ---------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._normalization != "model" and batch_samples:
            batch_samples = self._adapter.window(self, batch_samples)  # GRPO: generated and scored here
        if self._planner.pending_probe is not None and batch_samples:
            self._probe_through_engine(batch_samples[0])
        if self._normalization != "model" and batch_samples:
            self._window_engine(batch_samples[0]).begin(batch_samples)
        return batch_samples, num_items_in_batch

    def _prepare_inputs(self, inputs):
        if self._adapter.prepared(inputs):  # a batch the window built (GRPO's generated completions)
            return inputs
        return super()._prepare_inputs(inputs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._normalization == "model":
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self._window_engine(inputs)
        if not engine.active:  # called outside the Trainer loop: the window is this one batch
            engine.begin([inputs])
        self._forwarded_tokens = 0
        returned = engine.step(inputs, lambda chunk, final: self._chunk_step(model, chunk, final))
        if not engine.active:
            self._window_ended = True  # the optimizer step follows: `_maybe_log_save_evaluate` acts on it
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

    def _gradients_finite(self):
        return finite_grads.gradients_finite(self.model.parameters())

    def _window_engine(self, batch) -> WindowEngine:
        if self._engine is None:
            self._engine = self._build_engine(batch, self.accelerator.num_processes)
        return self._engine

    def _build_engine(self, batch, world: int) -> WindowEngine:
        cutter = self._adapter.cutter(make_cutter(self.batch_unit or detect_unit(batch), self._label_spec()))
        collective = TorchDistributed(world, self.args.device) if world > 1 else Local()
        policy = self.engine.window_policy(self.collectives_in_compute_loss)
        engine = WindowEngine(cutter, self._normalization, WindowProtocol(collective, policy),
                              shrink=_weakly(self._planner.after_oom), reset=_weakly(self._zero_grad),
                              shrink_tokens=_weakly(self._planner.after_oom_tokens), device=self.args.device)
        self._planner.configure(engine)
        engine.stop_requested = self._stop_request.__bool__
        if self._skips_nonfinite and self.accelerator.scaler is None:  # fp16 AMP: its scaler skips overflows itself
            engine.gradients_finite = _weakly(self._gradients_finite)
        return engine

    def _zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def _label_spec(self) -> LabelSpec:
        own = self._adapter.label_spec(self)
        if own is not None:
            return own
        return label_spec(self.model, self.args.label_names, custom_loss=trainer_internals.computes_own_loss(self))

    # --- one chunk: the Trainer's own training_step, its loss scaled to the chunk's exact share -------------------
    def _chunk_step(self, model, inputs, final: bool):
        engine = self._engine
        local = engine.cutter.count(inputs, engine.mode)
        # Every loss path divides by num_items_in_batch (or its own count, the same number): a chunk mean.
        # Clamped so an all-masked chunk gives 0 instead of 0/0 on paths that divide by it.
        local_for_loss = local.clamp(min=1).to(self.args.device)
        own = self._adapter.share(self)  # GRPO's token losses divide by the window's count themselves
        share = engine.share(local) if own is None else own
        scale, undo = share, 1
        if trainer_internals.trainer_divides_by_accumulation(self, local_for_loss):
            undo = trainer_internals.window_length(self)
            scale = share * undo  # pre-compensate training_step's division
        scaled = scaled_loss.loss_scaled(self, engine, scale, final, undo)
        inputs, adapted = self._adapter.chunk(self, inputs, local_for_loss)
        with self.engine.chunk(model, final), scaled as raw, adapted:
            returned = super().training_step(model, inputs, local_for_loss)
        self._forwarded_tokens += trainer_internals.main_input_tokens(self, inputs)
        if not self._post_checked:
            self._post_checked = True
            scaled_loss.check_post_processing(returned, raw, share)
        return returned

    # --- planning ---------------------------------------------------------------------------------------------
    def apply_plan(self, plan: Plan, *, in_training_loop: bool = False) -> None:
        """Put ``plan`` in force (`Planner.apply`: the one writer of the batch settings it implies)."""
        self._planner.apply(plan, in_training_loop=in_training_loop)

    @trl_internals.trl_metrics_kept
    @with_fused_loss
    def tune(self) -> Plan:
        """Measure (or reuse the stored plan), plan micro x accumulation x world = target, apply it."""
        with stopping.refusal_leaves_output_dir(self):
            if not self._checked_before_probe:  # train() checked already
                self._check_before_probe()
            return self._planner.tune()

    def _check_before_probe(self) -> None:
        """Everything the arguments, the data and the model's config can tell, before any model work and before
        anything is written to output_dir (`preflight.py`)."""
        check_model_computes_a_loss(self)
        if self._normalization != "model":
            self._label_spec()  # refuses a model whose loss hf_accum cannot drive exactly
        if self._adapter.check_data(self):
            check_training_data(self)
        if self.settings.tunes and self.args.should_save:
            check_output_dir_writable(self.args.output_dir)

    @trl_internals.trl_metrics_kept
    def _probe_through_engine(self, batch) -> None:
        def train_step(inputs):  # one real step through the engine, which steps its optimizer at the boundary
            with self.engine.boundary(True), trainer_internals.window_length_set(self, 1):
                super(AccumulationMixin, self).training_step(self.engine.live_model(), inputs)

        self._planner.probe_through_engine(self._window_engine(batch), train_step, self._collective())

    def _collective(self):
        world = self.accelerator.num_processes
        return TorchDistributed(world, self.args.device) if world > 1 else Local()

    @with_fused_loss
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        try:
            with stopping.refusal_leaves_output_dir(self):
                resume_from_checkpoint = self._check_and_plan(resume_from_checkpoint)
            self._check_figures = {}
            if self.settings.check_accumulation:
                self._check_figures = accumulation_check.report_before_training(self.check_accumulation())
            handle = self.settings.handle_preemption and self._normalization != "model"
            self._window_ended, self._figures_logged = False, False
            try:
                with self._stop_request.installed(handle):
                    output = super().train(resume_from_checkpoint, *args, **kwargs)
            except StopTraining as exc:
                raise StopTraining(stopping.stop_message(self, str(exc))) from None
            stopping.raise_if_stopped(self)
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
        stopping.refuse_unresumable(self.engine, resume_from_checkpoint)
        self._check_before_probe()
        # a run's checkpoints belong to its target batch (`checkpoints.check_resume`): True resolved, its plan
        resume_from_checkpoint, stored = check_resume(self.args, resume_from_checkpoint,
                                                      deepspeed=self.engine.own_optimizer_files)
        self._checked_before_probe = True
        levers.apply_requested(self.model, self.args)  # an explicit k (True: Trainer.train sets it)
        self._planner.start(stored, resume_from_checkpoint)
        self._adapter.before_train(self)
        return resume_from_checkpoint

    def _resume_advice(self, where: str) -> str:
        return stopping.resume_advice(self, where)

    # --- self-check -------------------------------------------------------------------------------------------
    @trl_internals.trl_metrics_kept
    def check_accumulation(self, num_micro_batches: int | None = None, tolerance: float | None = None) -> AccumulationCheck:
        """Compare the gradient of k micro-batches with one pass over the same samples on the real model and data.

        See `accumulation_check.run_accumulation_check`; every gradient, weight and RNG state is restored.
        """
        if tolerance is None:
            tolerance = self.settings.check_accumulation_tolerance
        return run_accumulation_check(self, num_micro_batches=num_micro_batches, tolerance=tolerance)



def _weakly(method):
    """A callable for `method` that does not keep its trainer alive (no cycle: `del trainer` frees the model)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


class AccumTrainer(AccumulationMixin, Trainer):
    """Drop-in `transformers.Trainer`; pass `AccumTrainingArguments` to choose how the loss is normalized,
    and a `target_batch_size` to have the micro-batch and accumulation planned from measured memory.

    With plain `TrainingArguments` it behaves as `loss_normalization="tokens"` and never auto-tunes.
    """


__all__ = ["AccumTrainer", "AccumulationMixin", "PLAN_FILE"]
