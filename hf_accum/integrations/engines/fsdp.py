"""FSDP: through accelerate (``fsdp=``), or FSDP2's `fully_shard` / transformers' sharding at load time applied to
the model itself. Forwards all-gather parameters, so no rank may skip one (`protocol.py`'s ``stop``); the gradient
sync switch of a model sharded in place is on the model (`compat.parallel.no_gradient_sync`); a model sharded at
load time has no optimizer state in its checkpoints, so its runs cannot be resumed."""

from __future__ import annotations

from ...compat import parallel
from .base import Engine


class Fsdp(Engine):
    def __init__(self, trainer):
        super().__init__(trainer)
        sharded_at_load = parallel.sharded_at_load(trainer.model)
        self.resumable = self.checkpoints_optimizer = not sharded_at_load
        # sharded in place, the model all-gathers in every forward of the probe too (accelerate's wrapper comes later)
        self.probe_runs_collectives = sharded_in_place(trainer.model)

    def no_sync(self, model):
        # FSDP2 applied at load time is no accelerate wrapper: its switch is on the model itself.
        return parallel.no_gradient_sync(model) if parallel.is_fsdp2(model) else self.trainer.accelerator.no_sync(model)

    def window_policy(self, collectives_in_compute_loss: bool):
        from ...window.protocol import Policy

        return Policy.STOP


def sharded_in_place(model) -> bool:
    """Parameters sharded in place: FSDP2's `fully_shard`, transformers' sharding at load, DTensors."""
    return parallel.is_fsdp2(model) or parallel.sharded_at_load(model) or parallel.has_dtensors(model)


def runs(trainer) -> bool:
    """FSDP runs this trainer: accelerate's FSDP, or parameters sharded in place (FSDP2, sharded at load: DTensors)."""
    return parallel.accelerate_fsdp(trainer) or sharded_in_place(trainer.model)


__all__ = ["Fsdp", "runs", "sharded_in_place"]
