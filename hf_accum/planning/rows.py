"""The plan's rows per forward lent to code that reads them from the arguments (TRL), for one block: a write of the
plan's fields, so it lives in planning/ beside the Planner, in a module of its own that imports nothing of ours
(GRPO's adapter and the TRL configs use it without importing the planner)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def rows_per_device(args, rows: int | None):
    """``rows`` as per_device_train_batch_size on ``args`` for the block, the value before restored after (None: as
    is). Where TRL itself reads it as a number of rows: GRPOTrainer's no-gradient forwards during generation (the
    plan's rows per forward, while each rank loads its whole window) and GRPOConfig's derivation of the generation
    batch before a plan exists (trl.AccumGRPOConfig). Beside the planner, the other writer of the plan's fields."""
    saved = args.per_device_train_batch_size
    args.per_device_train_batch_size = rows or saved
    try:
        yield
    finally:
        args.per_device_train_batch_size = saved
