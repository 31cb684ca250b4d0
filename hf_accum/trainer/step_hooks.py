"""What `AccumulationMixin` does after each optimizer step, at each checkpoint and in a run's first log entry: the
step control (stop at a step the ranks agreed on, or after too many non-finite windows in a row; tell the planner the
step ended, so a lowered plan can grow back), the plan saved with each checkpoint, and the plan's figures riding on
the first entry the run logs. Trainer methods, not callbacks, so the user's callback list is the Trainer's.

Reads the state `AccumulationMixin.__init__` sets (`_planner`, `_engine`, `_controls_steps`, `_window_ended`,
`_nonfinite_streak`, `_figures_logged`, `_check_figures`, `_plans_in_checkpoints`).
"""

from __future__ import annotations

import logging
import os

from ..compat import node_saving, trainer_internals

logger = logging.getLogger("hf_accum.trainer")


class StepHooks:
    """The overrides after each optimizer step (`AccumulationMixin`'s first base: it comes before the Trainer)."""

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        # The Trainer's loop calls this right after the callbacks' on_step_end (and again at an epoch's end): the
        # step control acts once per optimizer step whose window ran, before the Trainer logs and saves.
        if self._controls_steps and self._window_ended:
            self._window_ended = False
            self._after_step()
        return super()._maybe_log_save_evaluate(*args, **kwargs)

    def _after_step(self) -> None:
        """Ends the Trainer's loop, with a checkpoint, after a step the ranks agreed to stop at (a signal) or after
        too many non-finite steps in a row; then tells the planner the step ended and whether an OOM re-ran its
        window (growing back a lowered plan: `Planner.step_ended`)."""
        outcome = self._engine.outcome
        if not outcome.skip:
            self._nonfinite_streak = 0
        limit = self._nonfinite_limit
        if outcome.stop or (limit is not None and self._nonfinite_streak > limit):
            self.control.should_save = True
            self.control.should_training_stop = True
        self._planner.step_ended(outcome.reran)

    def _save(self, output_dir=None, state_dict=None):
        # save_on_each_node: each node's local rank 0 writes the model, as the Trainer asks (compat.node_saving)
        with node_saving.each_node(self.model, self.args.save_on_each_node):
            return super()._save(output_dir, state_dict=state_dict)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self._plans_in_checkpoints:  # each checkpoint carries the plan in force: a resume knows its target
            self._save_plan_with_checkpoint()

    def _save_plan_with_checkpoint(self) -> None:
        planner, args = self._planner, self.args
        plan = None if planner.plan_given else planner.plan  # a recorded given plan: as before, from the args
        if plan is None and self.settings.target_batch_size:
            plan = planner.given_plan()
        folder = os.path.join(args.output_dir, f"checkpoint-{self.state.global_step}")
        if plan is not None and args.should_save and os.path.isdir(folder):
            planner.save(folder, probe=False, plan=plan, figures=self._first_entry_figures())

    def _first_entry_figures(self) -> dict[str, float]:
        """What this run's first log entry carries: a resumed run's, the stored ones of the run that wrote its
        checkpoint (its history may hold no entry yet: the uninterrupted run's first entry had those, not the
        resumed run's plan_reused, budget or check); a fresh run's, the plan's and `check_accumulation`'s."""
        if self._planner.resumed_figures is not None:
            return self._planner.resumed_figures
        return {**(self._planner.figures or {}), **self._check_figures}

    def log(self, logs, *args, **kwargs):
        """The plan's figures (`hf_accum/...`) go with the first entry a run logs, whatever it is (a training loss,
        an evaluation, the run's summary): no entry of their own, so `log_history[i]` and the `on_log` events are
        the Trainer's. A resumed run's history is its checkpoint's, which holds them already, or is empty (saved
        before the first entry): then the stored figures of the run that wrote it go with it
        (`_first_entry_figures`); its own plan is in `trainer.plan` and the plan file. Recorded for `report_to`,
        not printed (the plan line said them). `check_accumulation`'s figure goes with them (its line said it)."""
        figures = self._first_entry_figures()
        if self._figures_logged or not figures or not self.is_in_train:
            return super().log(logs, *args, **kwargs)
        self._figures_logged = True
        if self.state.log_history:  # resumed
            return super().log(logs, *args, **kwargs)
        merged = {**logs, **figures}
        with trainer_internals.printers_without(self, figures):
            returned = super().log(merged, *args, **kwargs)
        # what the Trainer (and TRL) add to or take from the caller's dict, as without the figures (TRL's eval
        # metrics reach the dict `evaluate()` returns this way)
        for key in [k for k in logs if k not in merged]:
            del logs[key]
        logs.update({k: v for k, v in merged.items() if k not in figures})
        return returned

    def _skip_step(self, model) -> None:
        """A non-finite window loss on some rank: every rank drops the window's gradients (None, not zero: zero
        gradients still move AdamW's moments and weights); `_after_step` stops after too many in a row."""
        model.zero_grad(set_to_none=True)
        self._nonfinite_streak += 1
        logger.warning("hf_accum: the loss or gradients of the window of optimizer step %d are not finite; that step "
                       "is skipped (gradients dropped; %d in a row)", self.state.global_step + 1, self._nonfinite_streak)
