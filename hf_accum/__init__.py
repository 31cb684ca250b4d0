"""hf_accum: exact gradient accumulation and memory-aware batch planning for transformers' Trainer."""

__version__ = "0.1.0"

from .args import AccumTrainingArguments  # noqa: E402
from .trainer import AccumTrainer  # noqa: E402

__all__ = ["AccumTrainer", "AccumTrainingArguments", "__version__"]
