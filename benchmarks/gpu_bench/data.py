"""Long-tailed data, the collator, the trainers the sections build, budgets and goals."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hf_accum.probing.probe import make_step_fn, random_token_batch
from hf_accum.window.oom import free_memory

from .context import Ctx


# --- data ---------------------------------------------------------------------------------------------------------
def long_tailed_lengths(n: int, longest: int, seed: int, every_longest: int = 16) -> list[int]:
    """Lognormal lengths (median longest / 8) clipped to [8, longest]; every ``every_longest``-th is the longest:
    the worst case the probe measures is in the data, and training meets it."""
    g = random.Random(seed)
    median = max(8, longest // 8)
    out = [min(longest, max(8, round(math.exp(math.log(median) + g.gauss(0, 1.0))))) for _ in range(n)]
    for i in range(0, n, every_longest):
        out[i] = longest
    g.shuffle(out)
    return out


def lm_rows(lengths: list[int], vocab: int, seed: int) -> list[dict[str, Any]]:
    g = random.Random(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = [g.randrange(1, vocab) for _ in range(n)]
        rows.append({"input_ids": ids, "labels": [-100] * (n // 4) + ids[n // 4:], "idx": i})
    return rows


class PadCollator:
    """Right-pads to the longest row; records which rows (``idx``) it collated, so a test of 'every sample once'
    reads what the Trainer really loaded."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, features):
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for r, f in enumerate(features):
            n = len(f["input_ids"])
            ids[r, :n] = torch.tensor(f["input_ids"])
            mask[r, :n] = 1
            labels[r, :n] = torch.tensor(f["labels"])
            if "idx" in f:
                self.seen.append(int(f["idx"]))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# --- trainers -----------------------------------------------------------------------------------------------------
class StepTimes:
    """Wall time of each optimizer step (the device synchronized at each end, for every trainer alike)."""

    def __new__(cls, ctx: Ctx):
        from transformers import TrainerCallback

        class _StepTimes(TrainerCallback):
            def __init__(self):
                self.stamps: list[float] = []

            def on_step_begin(self, args, state, control, **kwargs):
                if not self.stamps:
                    ctx.sync()
                    self.stamps.append(time.perf_counter())

            def on_step_end(self, args, state, control, **kwargs):
                ctx.sync()
                self.stamps.append(time.perf_counter())

            def steady(self, skip: int = 2) -> float | None:
                gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])][skip:]
                return statistics.median(gaps) if gaps else None

        return _StepTimes()


class OOMLog(logging.Handler):
    """Counts hf_accum's 'out of memory at step' warnings: each is one recovered OOM."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "out of memory" in message:
            self.messages.append(message)


@contextlib.contextmanager
def oom_log():
    handler = OOMLog()
    logger = logging.getLogger("hf_accum")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def make_trainer(ctx: Ctx, model, rows, out: str, *, accum_trainer: bool = True, callbacks=(), collator=None,
                 **kwargs):
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments

    common = dict(output_dir=out, report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True,
                  remove_unused_columns=False, learning_rate=1e-5, max_grad_norm=1.0, seed=0, use_cpu=not ctx.cuda,
                  dataloader_drop_last=True)
    common.update(kwargs)
    args = (AccumTrainingArguments if accum_trainer else TrainingArguments)(**common)
    trainer = (AccumTrainer if accum_trainer else Trainer)(
        model=model, args=args, train_dataset=rows, data_collator=collator or PadCollator(), callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)
    return trainer


def budget_kwargs(ctx: Ctx, budget: tuple[str, float], peak1: Callable[[], int]) -> dict[str, Any]:
    kind, value = budget
    if kind == "fraction":
        return {"memory_budget": value}
    return {"memory_budget_bytes": int(value * peak1())}


def peak_at_one(ctx: Ctx, model, seq: int) -> int:
    """Charged bytes of one training step at micro-batch 1 (fresh AdamW, its state made by a warm-up step)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    step = make_step_fn(model, opt, random_token_batch(model, seq))
    try:
        step(1)
        return ctx.meter(model, opt).measure(lambda: step(1)).charged_bytes
    finally:
        opt.state.clear()
        model.zero_grad(set_to_none=True)
        del opt
        free_memory()


def budget_label(budget: tuple[str, float]) -> str:
    kind, value = budget
    return f"{value:g} of usable" if kind == "fraction" else f"{value:g} x peak(1)"


def goal(name: str, value, target: str, passed: bool | None) -> dict[str, Any]:
    return {"name": name, "value": value, "goal": target, "pass": passed}
