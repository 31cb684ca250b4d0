"""hf_accum: exact gradient accumulation and memory-aware batch planning for transformers' Trainer."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .compat import _quiet, allocator  # noqa: F401 - allocator: PYTORCH_CUDA_ALLOC_CONF before any CUDA work

__version__ = "0.1.0"

_quiet.install()  # a few exact messages of other libraries that no user can act on (see _quiet.py)

# Imported on first use: `import hf_accum` (and so `hf-accum --help`) must not pay for torch and transformers.
_LAZY = {"AccumTrainer": ".trainer", "AccumTrainingArguments": ".args", "AccumulationMixin": ".trainer",
         "AccumSeq2SeqTrainer": ".trainer.seq2seq", "AccumSeq2SeqTrainingArguments": ".trainer.seq2seq", "estimate": ".probing.paper"}

if TYPE_CHECKING:
    from .args import AccumTrainingArguments
    from .probing.paper import estimate
    from .trainer.mixin import AccumTrainer, AccumulationMixin
    from .trainer.seq2seq import AccumSeq2SeqTrainer, AccumSeq2SeqTrainingArguments


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["AccumSeq2SeqTrainer", "AccumSeq2SeqTrainingArguments", "AccumTrainer", "AccumTrainingArguments",
           "AccumulationMixin", "__version__", "estimate"]
