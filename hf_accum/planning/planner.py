"""`Planner`: the one writer of plan state (as transformers' `_update_auto_batch_size` is of its batch size).

Everything the plan decides is written here and nowhere else: the plan, its key and the probe record; the per-device
train and eval batch sizes and the accumulation steps on the trainer's copy of the arguments; the Trainer's private
`_train_batch_size`; the window engine's cut and token budget; the engine's batch (DeepSpeed's batch fields, through
the engine seam `trainer.engine`); the plan file. It writes at
start (probe, stored or given plan), after an out-of-memory error (through its `OomPolicy`), when a lowered plan grows
back (`step_ended`, after `grow_back_steps` clean optimizer steps) and when the eval batch is measured. The trainer
reads `trainer.plan`; recipes and the CLI save through `save()`.

The planner holds its trainer weakly and never imports the trainer: what must run through the Trainer (one real
training step through the DeepSpeed engine, one prediction step) is handed in as a step function.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable

from ..config.fit_hints import fit_hints, levers_on
from ..config.settings import Settings
from ..levers import get_lever
from ..probing.engine import probe_through_engine
from ..probing.plan import Plan
from ..window.protocol import Collective, StopTraining
from ..window.token_budget import PADDING_TARGET, TokenBudget, plan_budget
from . import tuning
from .eval_batch import plan_eval_batch
from .growback import GrowBack
from .policy import InForce, OomPolicy, as_plan
from .store import save_plan, stored_figures

logger = logging.getLogger(__name__)


def _say_cut_rule(plan: Plan, args) -> None:
    """Once, as a plan is applied before training: a token budget without step times cuts by the padding rule."""
    if plan.token_budget is None or plan.step_time is not None:
        return
    why = ("auto_tune=False: nothing was timed" if not Settings(args).tunes
           else "the plan holds no step times (a plan file stored before they were measured, or a probe that timed "
                "nothing)")
    logger.warning("hf_accum: micro_batching='tokens' cuts each window by the padding rule (one more forward while "
                   "it pads more than %.2f tokens per real token), not by modelled step time: %s. Probe again to cut "
                   "by step time (auto_tune=True, the stored plan file removed).", PADDING_TARGET, why)


class Planner:
    """The plan of one trainer and every write it implies. ``policy`` decides what an OOM lowers to."""

    def __init__(self, trainer, policy: OomPolicy | None = None):
        self._trainer_ref = weakref.ref(trainer)  # the trainer holds its planner: no cycle keeps the model alive
        self.policy = policy or OomPolicy()
        self.plan: Plan | None = None
        self.plan_given = False  # self.plan only records the sizes as given (auto_tune off): never stored
        self.key: dict | None = None
        self.probe_result = None
        self.reused_probe: dict | None = None  # the probe record of a reused plan file: kept when it is rewritten
        self.budget_bytes: int | None = None  # the memory budget tune() resolved (the eval batch is measured in it)
        self.pending_probe: tuning.Prepared | None = None  # probed through the engine (DeepSpeed), in the loop
        self.figures: dict[str, float] | None = None  # the plan's figures, for the run's first log entry
        # a resumed run's: the first entry's figures of the run that wrote its checkpoint (None: a fresh run, or a
        # checkpoint that kept none); logged in place of its own while its history holds none yet
        self.resumed_figures: dict[str, float] | None = None
        self.probing = False  # left set when the probe stops the run: the stop message says so
        self.stores_plan = True  # `hf-accum probe RECIPE` saves the plan itself, where it is kept
        self.eval_planned = False  # auto_eval_batch_size: measured (or taken from a stored plan)
        self._whole_windows: bool | None = None  # how the applied plan is loaded (`loads_windows`)
        self.growback = GrowBack(Settings(trainer.args).grow_back_steps)  # when a plan an OOM lowered returns
        self.before_oom: Plan | None = None  # the plan in force before the first OOM lowered it
        self._oom_step = 0  # the step of the last OOM, as its warning named it

    @property
    def _trainer(self):
        return self._trainer_ref()

    # --- reading ----------------------------------------------------------------------------------------------
    def loads_windows(self) -> bool:
        """Each rank loads its whole window and the engine cuts it (the plan's near-equal forwards, or a token
        budget): whenever hf_accum plans; micro-batches are loaded as given only when the user set them. Fixed
        when a plan is applied (a recipe turns auto_tune off once it has planned)."""
        return self._whole_windows if self._whole_windows is not None else self._args_load_windows()

    def _args_load_windows(self) -> bool:
        args = self._trainer.args
        return bool(Settings(args).tunes) or Settings(args).micro_batching == "tokens"

    def cut(self, plan: Plan | None) -> int | None:
        """The engine's units per forward for ``plan`` (None: each loaded batch is one forward, or a token budget
        cuts it)."""
        if plan is None or plan.token_budget is not None or not self.loads_windows():
            return None
        return plan.micro_batch_size

    def on_engine(self, plan: Plan) -> Plan:
        """The plan, naming the sharded engine that runs it (DeepSpeed and its ZeRO stage)."""
        label = self._trainer.engine.label
        return plan if label is None else dataclasses.replace(plan, engine=label)

    def given_plan(self) -> Plan:
        """The arguments' own micro-batch and accumulation as a plan (a run with a target but no plan of its own)."""
        args = self._trainer.args
        return self.on_engine(Plan(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                   args.world_size, args.target_batch_size))

    # --- writing ----------------------------------------------------------------------------------------------
    def configure(self, engine) -> None:
        """A window engine just built gets the plan's cut and token budget."""
        engine.token_budget = plan_budget(self.plan)
        engine.cut_units = self.cut(self.plan)

    def apply(self, plan: Plan, *, in_training_loop: bool = False) -> None:
        """Before training, set the batch size the dataloader is built with. Inside the loop the dataloader and
        the loop's window length are fixed, so the engine cuts each loaded batch into chunks of the new size
        (same samples per window: the effective batch and step count are kept); here the plan is only recorded."""
        trainer, args = self._trainer, self._trainer.args
        plan = self.on_engine(plan)
        if not in_training_loop:
            trainer.engine.check_plan(plan)  # before anything changes
            _say_cut_rule(plan, args)
        engine = trainer._engine
        if engine is not None:
            engine.token_budget = plan_budget(plan)
        if not in_training_loop:
            # loaded whole, each window is cut by the engine (`cut`); else transformers loads the micro-batches
            self._whole_windows = self._args_load_windows()
            micro, accumulation = ((plan.window, 1) if self._whole_windows
                                   else (plan.micro_batch_size, plan.gradient_accumulation_steps))
            args.per_device_train_batch_size = micro
            args.gradient_accumulation_steps = accumulation
            set_train_batch_size(trainer, micro)
            if engine is not None:
                engine.cut_units = self.cut(plan)
            trainer.engine.plan_applied()  # the engine train() builds gets the plan (DeepSpeed's config)
        if plan.eval_batch_size is not None:  # a stored plan: measured at an earlier run's first evaluation
            args.per_device_eval_batch_size = plan.eval_batch_size
            self.eval_planned = True
        if not in_training_loop:
            for name, record in (plan.levers or {}).items():  # a stored plan's levels too
                get_lever(name).apply(trainer.model, record, args)
        self.plan, self.plan_given = plan, False
        if in_training_loop and args.should_save:  # tune() saved the plan it applies, with its probe
            self.save(args.output_dir, probe=False)

    def save(self, folder: str, *, probe: bool = True, plan: Plan | None = None,
             figures: dict[str, float] | None = None) -> str:
        """The plan file in ``folder`` (with what the probe measured unless ``probe`` is False; a checkpoint's with
        its run's first-entry ``figures``). Returns its path."""
        record = None if not probe else self.probe_result.to_dict() if self.probe_result is not None \
            else self.reused_probe
        return save_plan(folder, self.key or {}, plan or self.plan, record, figures)

    # --- at start ---------------------------------------------------------------------------------------------
    def start(self, stored: Plan | None, resuming) -> None:
        """The plan train() runs with: probed (or reused from the plan file), given, or the checkpoint's."""
        trainer, args = self._trainer, self._trainer.args
        self.resumed_figures = stored_figures(resuming) if resuming else None
        if self.plan_given:  # recorded by an earlier train(): the arguments may have changed since
            self.plan, self.plan_given = None, False
        tunes = Settings(args).tunes
        if tunes and self.plan is None and trainer.engine.probes_through_engine:
            self._tune_through_engine()
        elif tunes and self.plan is None:  # a tune() before train() counts
            trainer.tune()
        elif Settings(args).micro_batching == "tokens" and self.plan is None:
            self.apply(self._given_token_plan())
        elif stored is not None and resuming:
            self.apply(stored)  # the plan in force when the checkpoint was written (maybe downgraded)
        if self.plan is None:  # the sizes as given are the plan in force: trainer.plan.describe() works
            world = trainer.accelerator.num_processes
            micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
            self.plan, self.plan_given = Plan(micro, accumulation, world, Settings(args).given_batch(world)), True

    def _given_token_plan(self) -> Plan:
        """micro_batching="tokens" with auto_tune off: the window as given, loaded whole, cut by the given budget."""
        trainer = self._trainer
        args, world = trainer.args, trainer.accelerator.num_processes
        per_rank = Settings(args).given_batch(world=1)
        return Plan(per_rank, 1, world, per_rank * world, token_budget=args.max_tokens_per_forward)

    def tune(self) -> Plan:
        """Measure (or reuse the stored plan), plan micro x accumulation x world = target, apply it."""
        trainer = self._trainer
        prepared = tuning.prepare(trainer)
        self.budget_bytes = prepared.budget
        problem = trainer.engine.probe_before_train(trainer.args.target_batch_size) if prepared.stored is None else None
        if problem:
            raise ValueError(problem)
        plan, self.probe_result, self.key = tuning.tune(trainer, prepared, store=self.stores_plan)
        self.reused_probe = prepared.stored[1].get("probe") if prepared.stored is not None else None
        self.apply(plan)
        return plan

    def _tune_through_engine(self) -> None:
        """Where the probe runs through the engine (DeepSpeed), a stored plan is applied as usual; otherwise each
        rank loads its whole window (micro = the per-rank target, accumulation 1: the engine is built for that) and
        the probe runs through the engine at the first window (`probe_through_engine`), whose plan then cuts every
        loaded window."""
        trainer = self._trainer
        prepared = tuning.prepare(trainer)
        if prepared.stored is not None:
            plan, self.probe_result, self.key = tuning.tune(trainer, prepared, store=self.stores_plan)
            self.reused_probe = prepared.stored[1].get("probe")
            self.apply(plan)
            return
        target = trainer.args.target_batch_size
        world = trainer.args.world_size
        self.apply(Plan(target // world, 1, world, target))
        self.plan = None  # the loading plan is not a plan: the probe has not run
        self.pending_probe = prepared

    def probe_through_engine(self, engine, train_step: Callable, collective: Collective) -> None:
        """The probe pending since `start`, run through the live engine (DeepSpeed) (``train_step(batch)``: one real
        step through it), then the plan cuts every loaded window of ``engine``."""
        trainer = self._trainer
        prepared, self.pending_probe = self.pending_probe, None

        def probe(make, length, max_micro=trainer.args.probe_max_micro_batch):
            return probe_through_engine(trainer, collective=collective, train_step=train_step, make_batch=make,
                                        seq_len=length, budget_bytes=prepared.budget, meter=prepared.meter,
                                        budget_names=" or ".join(tuning.BUDGET_NAMES), max_micro_batch=max_micro,
                                        log=logger.info)

        self.probing = True
        plan, self.probe_result, self.key = tuning.tune(trainer, prepared, probe, store=self.stores_plan)
        self.probing = False
        self.plan = plan = self.on_engine(plan)
        self.configure(engine)  # each loaded window, cut into the plan's forwards
        # the engine loads whole windows, as the Trainer does; hf_accum sets its boundary per forward
        trainer.engine.set_live_batch(plan.window, 1)

    # --- after an out-of-memory error -------------------------------------------------------------------------
    def _in_force(self, units: int | None) -> InForce:
        trainer = self._trainer
        args, engine = trainer.args, trainer._engine
        world = engine.world if engine is not None else trainer.accelerator.num_processes
        return InForce(self.plan, units, world, self.loads_windows(), args.per_device_train_batch_size,
                       Settings(args).exact_target(world))

    def smaller(self, units: int | None = None) -> Plan | None:
        """The plan the policy lowers to from the cut ``units`` in force (None: the plan's own)."""
        plan = self.policy.smaller(self._in_force(units))
        return None if plan is None else self.on_engine(plan)

    def after_oom(self, units: int | None) -> int:
        """The engine's next cut after an OOM, applied as the plan in force (the effective batch and the step
        count are kept)."""
        trainer = self._trainer
        self._refuse_rerun()
        plan = self.smaller(units)
        if plan is None:
            raise RuntimeError(
                "hf_accum: out of memory at micro-batch 1, so no smaller micro-batch can keep "
                f"target_batch_size. Checkpoints in {trainer.args.output_dir} are intact. To fit: "
                + fit_hints(levers_on(trainer.model), checkpointing="enable gradient_checkpointing",
                            rest=("shorten sequences", "free GPU memory held by other processes"))
                + "; then resume from the last checkpoint."
            )
        logger.warning("hf_accum: out of memory at step %d; re-running this accumulation window with %s",
                       trainer.state.global_step, plan.describe())
        self._lowering()
        self.apply(plan, in_training_loop=True)
        return plan.micro_batch_size

    def after_oom_tokens(self, budget: TokenBudget) -> TokenBudget:
        """micro_batching="tokens": after an OOM, the policy's smaller token budget (same samples, same windows)."""
        trainer = self._trainer
        self._refuse_rerun()
        longest = trainer._engine.longest_loaded_unit()
        smaller = self.policy.smaller_tokens(budget, longest)
        if smaller is None:
            raise RuntimeError(
                f"hf_accum: out of memory with a token budget of {budget}, and a smaller one cannot hold this window's "
                f"longest example ({longest} tokens). Checkpoints in {trainer.args.output_dir} are intact. To fit: "
                + fit_hints(levers_on(trainer.model), checkpointing="enable gradient_checkpointing",
                            rest=("shorten sequences", "free memory"))
                + "; then resume."
            )
        plan = dataclasses.replace(self.plan, token_budget=smaller.tokens, token_model=smaller.model)
        logger.warning("hf_accum: out of memory at step %d; re-running this accumulation window with %s",
                       trainer.state.global_step, plan.describe())
        self._lowering()
        self.apply(plan, in_training_loop=True)
        return smaller

    def _lowering(self) -> None:
        """Before an OOM's plan is applied: remember the plan it lowers (the first time: growing back returns to the
        plan the run started on, not to an intermediate one) and the step, for the growing-back line."""
        if self.before_oom is None:
            self.before_oom = as_plan(self._in_force(None))
        self._oom_step = self._trainer.state.global_step

    # --- growing back after an OOM (growback.py) -------------------------------------------------------------
    def step_ended(self, reran: bool) -> None:
        """After each optimizer step; ``reran``: an OOM re-ran its window (every rank agrees, so every rank counts
        the same steps). The plan in force before the OOM is restored when `GrowBack` says it is time."""
        if reran:
            self.growback.oom()
        elif self.growback.clean_step():
            self._grow_back()

    def _grow_back(self) -> None:
        """The plan before the OOM, through `apply` (plan, token budget, plan file) and the engine's cut: the next
        window is cut as the run's first were (any cut of a window is exact; the effective batch is unchanged)."""
        plan = self.policy.larger(self._in_force(None), self.before_oom)
        if plan is None:
            return
        # a warning, as the OOM's own line is: whoever saw the plan lowered sees it restored
        logger.warning("hf_accum: %d clean steps since the out-of-memory error at step %d; back to %s",
                       self.growback.wait, self._oom_step, plan.describe())
        self.apply(plan, in_training_loop=True)
        self._trainer._engine.cut_units = self.cut(self.plan)

    def _refuse_rerun(self) -> None:
        """Re-running a window needs its gradients cleared; an engine that reduces each backward's gradients into its
        own partitions (DeepSpeed ZeRO: `zero_grad` does not clear them) says why not, and an out-of-memory error
        then stops every rank, one process included, with the plan to restart with."""
        reason = self._trainer.engine.no_rerun_reason
        if reason:
            raise StopTraining(reason)

    def restart_setting(self) -> str:
        """What to restart with after a stop: the settings of the plan one step smaller than the one in force."""
        engine = self._trainer._engine
        plan = self.smaller(engine.cut_units if engine else None)
        if plan is None:
            return "a smaller model footprint"
        if self.loads_windows():
            return f"probe_max_micro_batch={plan.micro_batch_size} ({plan.describe()})"
        return (f"per_device_train_batch_size={plan.micro_batch_size} and gradient_accumulation_steps="
                f"{plan.gradient_accumulation_steps} ({plan.describe()})")

    # --- the eval batch ---------------------------------------------------------------------------------------
    def wants_eval_batch(self, collectives_in_compute_loss: bool) -> bool:
        """auto_eval_batch_size (default: with auto_tune), not measured yet, and measurable on this setup."""
        trainer = self._trainer
        auto = Settings(trainer.args).auto_eval_batch_size
        asked, auto = auto, Settings(trainer.args).tunes if auto is None else auto
        if not auto or self.eval_planned:
            return False
        if not trainer.engine.measures_eval_batch(collectives_in_compute_loss):
            # Each rank searches on its own: not where forwards run collectives (FSDP, ZeRO, TRL's metrics).
            self.eval_planned = True
            (logger.warning if asked else logger.info)(
                "hf_accum: auto_eval_batch_size is not measured where evaluation forwards run collectives (FSDP, "
                "DeepSpeed, TRL's metric gathering on several ranks); per_device_eval_batch_size stays %d.",
                trainer.args.per_device_eval_batch_size)
            return False
        return True

    def plan_eval_batch(self, dataset, run: Callable) -> None:
        """`auto_eval_batch_size`: measure evaluation steps now (``run(model, batch, loss_only)``: the Trainer's own
        prediction_step), with what training keeps resident (eval_batch.py)."""
        trainer = self._trainer
        args = trainer.args
        self.eval_planned = True
        choice = plan_eval_batch(trainer, dataset, budget=self.budget_bytes, run=run)
        if choice is None:
            return
        args.per_device_eval_batch_size = choice.batch_size
        if args.eval_accumulation_steps is None and choice.accumulation_steps is not None:
            args.eval_accumulation_steps = choice.accumulation_steps
        if self.plan is not None:
            self.plan = dataclasses.replace(self.plan, eval_batch_size=choice.batch_size)
            if args.should_save and Settings(args).target_batch_size and not self.plan_given:
                self.save(args.output_dir)


def set_train_batch_size(trainer, micro: int) -> None:
    """The batch size `Trainer.get_train_dataloader` and `train()` read is the private `_train_batch_size`
    (set from the arguments in `__init__`); a plan applied after `__init__` must set it too (pinned by
    test_compat.py: it fails when transformers renames the field)."""
    trainer._train_batch_size = micro
