"""`TrainerAdapter`: what a TRL trainer whose batches are not collated from the dataset needs from the mixin.

Most trainers load a window of collated batches and hf_accum cuts them (units.py). GRPOTrainer loads prompts and
builds its training batches itself, by generating completions and scoring them (grpo.py): the window exists only
after that. The mixin calls these hooks at its few seams, unconditionally; this base class is what every other
trainer gets (nothing changes). A subclass states only what differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping


class TrainerAdapter:
    """The mixin's hooks over one trainer class (the defaults: batches are what the dataloader collated)."""

    exact_eval = True  # hf_accum's exact eval_loss applies (evaluation.py); False: the trainer's own evaluation

    def normalization(self, args) -> str | None:
        """The loss normalization of a config without hf_accum's field (None: the table's default)."""
        return None

    def label_spec(self, trainer):
        """What counts as one target token of a window (None: the model's labels, loss.label_spec)."""
        return None

    def window(self, trainer, batch_samples: list) -> list:
        """The batches of one window, from what the dataloader loaded for it."""
        return batch_samples

    def prepared(self, inputs) -> bool:
        """Whether ``inputs`` is already a training batch (`window` built it): `_prepare_inputs` leaves it."""
        return False

    def chunk(self, trainer, inputs: Mapping, local_count) -> tuple[Mapping, contextlib.AbstractContextManager]:
        """One forward's inputs and the context it runs in, so that `compute_loss` returns the mean over
        ``local_count`` (the mixin's contract: it scales that mean to the chunk's share of the window)."""
        return inputs, contextlib.nullcontext()

    def share(self, trainer):
        """The factor of this forward's loss when `chunk` has it return its exact share of the window itself (None:
        it returns the mean over its own count, which the mixin scales to its share)."""
        return None

    def before_train(self, trainer) -> None:
        """Once the plan is in force, before `Trainer.train` builds the dataloader."""

    def cutter(self, cutter):
        """The window engine's `units.Cutter` (a subclass where the trainer's rows measure their length otherwise)."""
        return cutter

    def probe_batches(self, trainer, shortest: int | None = None):
        """``(make_batch, seq_len)`` for the probe: its training batches of ``micro`` units at the worst-case length,
        or (``shortest``) at the shortest length of at least that many tokens, for the token budget's second probe
        (None: the training examples, collated; planning/data_scan.py)."""
        return None

    def check_data(self, trainer) -> bool:
        """Whether hf_accum's checks of the training data (preflight.py) apply to its rows."""
        return True


NO_ADAPTER = TrainerAdapter()
