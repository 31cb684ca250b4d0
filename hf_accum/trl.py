"""TRL: `SFTTrainer` with hf_accum's memory-planned batch and exact loss normalization.

    from hf_accum.trl import AccumSFTConfig, AccumSFTTrainer   # was: from trl import SFTConfig, SFTTrainer

    args = AccumSFTConfig(output_dir="out", target_batch_size=64, max_length=1024, ...)
    trainer = AccumSFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.train()   # probes, plans micro x accumulation x world = 64, trains with the exact token mean

`AccumSFTConfig` is `SFTConfig` + `AccumTrainingArguments` (one dataclass: every field of both is a keyword, a
CLI flag for `HfArgumentParser` and a YAML key; both `__post_init__` checks run). `AccumSFTTrainer` is
`SFTTrainer` with `AccumulationMixin` in front: `SFTTrainer.training_step` (activation offloading context) and
`compute_loss` (TRL's fused LM head, its metrics) run unchanged inside hf_accum's window scaling. The same
composition works for other TRL trainers whose loss is a mean over counted tokens:
`class MyTrainer(AccumulationMixin, trl.SomeTrainer)`.

What the mixin adds over TRL's own normalization: the tuner (`target_batch_size`, `auto_tune`), OOM recovery,
`check_accumulation`, and the exact mean across data-parallel ranks whatever `average_tokens_across_devices`
says (it is turned off, logged, because hf_accum counts across ranks itself).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - trl is in the dev extra, optional for users
    raise ImportError(f"hf_accum.trl needs TRL ({exc}): pip install trl") from exc

from .args import AccumTrainingArguments
from .trainer import AccumulationMixin


@dataclass
class AccumSFTConfig(SFTConfig, AccumTrainingArguments):
    """`trl.SFTConfig` with hf_accum's fields (target_batch_size, auto_tune, loss_normalization, ...).

    SFTConfig's defaults win where both define a field (e.g. learning_rate 2e-5, logging_steps 10)."""


class AccumSFTTrainer(AccumulationMixin, SFTTrainer):
    """`trl.SFTTrainer` + hf_accum: pass an `AccumSFTConfig` (plain `SFTConfig` works too: tokens
    normalization, no tuning)."""

    collectives_in_compute_loss = True  # TRL gathers its metrics in compute_loss: no rank may skip a forward

    def tune(self):
        with self._trl_metrics_untouched():
            return super().tune()

    def check_accumulation(self, *args, **kwargs):
        with self._trl_metrics_untouched():
            return super().check_accumulation(*args, **kwargs)

    @contextlib.contextmanager
    def _trl_metrics_untouched(self):
        """The probe and the accumulation check run `compute_loss`, which in TRL appends to the logged metrics
        (entropy, token accuracy) and counts `num_tokens`; none of those steps are training, so undo that."""
        metrics = copy.deepcopy(getattr(self, "_metrics", None))
        tokens = getattr(self, "_total_train_tokens", None)
        try:
            yield
        finally:
            if metrics is not None:
                self._metrics = metrics
            if tokens is not None:
                self._total_train_tokens = tokens


__all__ = ["AccumSFTConfig", "AccumSFTTrainer"]
