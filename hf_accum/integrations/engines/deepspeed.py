"""DeepSpeed (through transformers' and accelerate's integration): the engine `train()` builds partitions the model
(ZeRO), takes the optimizer step inside the window's last backward and keeps its batch in its config. So the probe
runs through the live engine at the first window (`probing/engine.py`), the accumulation boundary is set per
forward, an out-of-memory error stops every rank (its partitions already hold the window's reduced gradients), and
its checkpoints are DeepSpeed's own files. The upstream pieces are in `compat/deepspeed_integration.py`."""

from __future__ import annotations

from ...compat import deepspeed_integration as ds
from .base import Engine


class DeepSpeed(Engine):
    steps_in_backward = True
    probes_through_engine = True
    own_optimizer_files = True
    no_rerun_reason = ("out of memory under DeepSpeed, whose engine already holds this window's reduced gradients in "
                       "its own partitions (they cannot be cleared to re-run the window)")

    def __init__(self, trainer):
        super().__init__(trainer)
        self.label = ds.engine_label(trainer)

    def boundary(self, final: bool):
        return ds.engine_boundary(self.trainer, final)

    def window_policy(self, collectives_in_compute_loss: bool):
        from ...window.protocol import Policy

        return Policy.STOP  # ZeRO gathers or reduces in every forward and backward

    def measures_eval_batch(self, collectives_in_compute_loss: bool) -> bool:
        return False  # the eval forwards run through the partitioned model

    def check_plan(self, plan) -> None:
        """Before the engine is built, its batch fields must be able to take the plan: an explicit value that
        contradicts it is refused, naming the field. (A live engine's fields are never changed: a plan changed
        inside the loop is applied by cutting loaded batches, the engine stepping once per window.) Launched with
        accelerate's DeepSpeed plugin instead of `deepspeed=`, its already-filled values must equal the plan."""
        from .deepspeed_batch import batch_contradiction

        trainer = self.trainer
        user = trainer.args.deepspeed
        config = ds.deepspeed_user_config(user) if user is not None else ds.deepspeed_batch_config(trainer)
        problem = batch_contradiction(config, plan.micro_batch_size, plan.gradient_accumulation_steps,
                                      plan.world_size, plan.describe())
        if problem:
            raise ValueError(problem)

    def plan_applied(self) -> None:
        if self.trainer.args.deepspeed is not None:
            # the engine, built in train(), gets the plan: "auto" batch fields filled from these arguments
            ds.fill_deepspeed_config(self.trainer)

    def probe_before_train(self, target: int | None) -> str | None:
        return ("tune() cannot probe a DeepSpeed run before train(): ZeRO partitions the model when train() builds "
                "the engine, and the probe measures through that engine. Call train() (it probes at the first "
                "window), or set auto_tune=False with per_device_train_batch_size x gradient_accumulation_steps x "
                f"world size = target_batch_size={target}.")

    def live_model(self):
        return ds.deepspeed_engine(self.trainer)

    def set_live_batch(self, micro: int, accumulation: int) -> None:
        ds.set_deepspeed_batch(self.trainer, micro, accumulation)

    def state_restored(self, scratch: str):
        return ds.deepspeed_state_restored(self.trainer, scratch)

    def buffers(self) -> dict[str, int]:
        return ds.deepspeed_buckets(self.trainer)


def runs(trainer) -> bool:
    """DeepSpeed's engine runs this trainer (accelerate's distributed type)."""
    return ds.engine_steps_in_backward(trainer)


__all__ = ["DeepSpeed", "runs"]
