"""The engine seam: what differs between the engines a Trainer can run on (one process, DDP, FSDP, DeepSpeed),
behind one small protocol that the trainer and the planner call without asking which engine runs (as transformers
keeps DeepSpeed in `integrations/deepspeed.py`).

`Engine` is the protocol and, as it stands, one process: every method has the plain behaviour, and each engine
module (`ddp.py`, `fsdp.py`, `deepspeed.py`) overrides only what differs. It covers:
- gradient sync: `chunk(model, final)`, the context one forward/backward of a window runs in (no gradient sync
  before the window's last; the accumulation boundary of an engine that steps inside backward);
- steps taken inside backward: `steps_in_backward`, `no_rerun_reason`;
- the window protocol's policy (`window_policy`) and whether one rank may forward alone in evaluation
  (`evaluates_alone`, `measures_eval_batch`);
- probing through the engine: `probes_through_engine` and what the probe needs of the live engine
  (`live_model`, `set_live_batch`, `state_restored`, `buffers`); `probe_runs_collectives` where the probe's steps
  of the model itself do (a model sharded in place), so that every rank runs the same trials;
- the batch the engine is built with (`check_plan` before it changes, `plan_applied` after);
- saving and restoring state: `own_optimizer_files`, `resumable`, `checkpoints_optimizer`;
- its label in plans and plan keys (`label`).
Upstream internals stay under `compat/`: these modules only call them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator


class Engine:
    """One process, no engine (the default); the other engines subclass it and override what differs."""

    label: str | None = None  # how plans and plan keys name the engine ("DeepSpeed ZeRO-3"); None: DDP or one process
    steps_in_backward = False  # the engine takes the optimizer step inside the window's last backward
    probes_through_engine = False  # the probe runs real steps through the engine `train()` builds, at the first window
    probe_runs_collectives = False  # the probe's steps of the model itself run collectives: every rank the same trials
    own_optimizer_files = False  # checkpoints hold the engine's own optimizer files, not the Trainer's
    resumable = True  # a checkpoint of this run can be resumed exactly
    checkpoints_optimizer = True  # transformers can checkpoint the optimizer state
    no_rerun_reason: str | None = None  # why an OOM cannot re-run a window here (every rank stops instead)

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)  # the trainer holds its engine: no cycle keeps the model alive

    @property
    def trainer(self):
        return self._trainer()

    # --- gradient sync ----------------------------------------------------------------------------------------
    def no_sync(self, model):
        """Backward without gradient synchronization (every forward of a window but its last)."""
        return self.trainer.accelerator.no_sync(model)

    @contextlib.contextmanager
    def chunk(self, model, final: bool) -> Iterator[None]:
        """The context one forward/backward of a window runs in: no gradient sync unless ``final``, and the
        engine's accumulation boundary at ``final`` only."""
        with contextlib.nullcontext() if final else self.no_sync(model), self.boundary(final):
            yield

    def boundary(self, final: bool):
        """The engine's accumulation boundary set to ``final`` for one backward (engines that step inside it)."""
        return contextlib.nullcontext()

    def window_policy(self, collectives_in_compute_loss: bool):
        """``stop`` where some forward or backward runs collectives, so one rank may not skip it; ``rerun``
        otherwise (`protocol.py`)."""
        from ...window.protocol import Policy

        return Policy.STOP if collectives_in_compute_loss else Policy.RERUN

    def evaluates_alone(self, collectives_in_compute_loss: bool) -> bool:
        """Whether one rank may forward more than the others in evaluation (an OOM re-run, the eval batch search):
        one process, or no collectives in forwards (not FSDP, ZeRO, TRL's metric gathering on several ranks)."""
        from ...window.protocol import Policy

        return (self.trainer.accelerator.num_processes == 1
                or self.window_policy(collectives_in_compute_loss) is Policy.RERUN)

    def measures_eval_batch(self, collectives_in_compute_loss: bool) -> bool:
        """Whether each rank may search the eval batch on its own (`auto_eval_batch_size`)."""
        return self.evaluates_alone(collectives_in_compute_loss)

    # --- the batch the engine is built with -------------------------------------------------------------------
    def check_plan(self, plan) -> None:
        """Before a plan is applied ahead of training: refuse one the engine's own settings contradict."""

    def plan_applied(self) -> None:
        """After a plan was applied to the arguments ahead of training: the engine `train()` builds gets it."""

    def probe_before_train(self, target: int | None) -> str | None:
        """Why `tune()` cannot probe before `train()` builds the engine (None: it can)."""
        return None

    # --- the live engine, for the probe through it ------------------------------------------------------------
    def live_model(self):
        """The model one real training step runs through."""
        return self.trainer.model_wrapped

    def set_live_batch(self, micro: int, accumulation: int) -> None:
        """The live engine's own batch fields (engines that keep one)."""

    def state_restored(self, scratch: str):
        """A context after which the engine's state is what it was before (the probe's real steps)."""
        return contextlib.nullcontext()

    def buffers(self) -> dict[str, int]:
        """The engine's own communication buffers, in elements, by the config key that sets each."""
        return {}


__all__ = ["Engine"]
