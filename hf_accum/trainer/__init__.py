"""The Trainer face: `AccumTrainer` and `AccumulationMixin` (`mixin.py`), `AccumSeq2SeqTrainer` and its arguments
(`seq2seq.py`), and the parts the mixin runs at its seams:
the refusals before work (`checks/`), what keeps a run alive and stops it cleanly (`resilience/`), the loss wrap of
each forward (`scaled_loss.py`), what it does after each optimizer step (`step_hooks.py`) and in evaluation
(`eval_hooks.py`).

The top of the library with `trl.py`, `recipes/` and the CLI above it: it imports every wing below, none imports
it. Its names load on first use, so `hf_accum.trainer.resilience.output_guard` (the CLI's) costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .mixin import AccumTrainer, AccumulationMixin
    from .seq2seq import AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments


def __getattr__(name: str) -> Any:
    if name in ("AccumTrainer", "AccumulationMixin"):
        return getattr(importlib.import_module(".mixin", __name__), name)
    if name in ("AccumSeq2SeqTrainer", "AccumSeq2SeqTrainingArguments"):
        return getattr(importlib.import_module(".seq2seq", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AccumSeq2SeqTrainer", "AccumSeq2SeqTrainingArguments", "AccumTrainer", "AccumulationMixin"]
