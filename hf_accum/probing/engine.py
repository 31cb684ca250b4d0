"""The probe through a live engine (DeepSpeed: `engines.deepspeed`), through the engine seam only.

ZeRO partitions parameters, gradients and optimizer state when the engine is built, gathers ZeRO-3's parameters
in every forward, and may offload: memory measured on the unwrapped model is not what training uses. So under
DeepSpeed `train()` builds the engine first (each rank loading its whole window, which any micro-batch can cut),
and at the first window the probe runs real steps through it — the Trainer's own `training_step` on the engine,
its backward, its optimizer step at the boundary — at each micro-batch under test; then the engine is put back as
it was (`Engine.state_restored`: weights, optimizer state, schedule, counters).

Those steps run collectives on every rank, so every rank must run the same trials in the same order: the budget
and the limit are the smallest over the ranks, and each measurement is the largest over the ranks (one exchange
per trial) before the search reads it (`agreed.py`). An out-of-memory error cannot be skipped by one rank (the
others would wait in a collective): it stops every rank, saying what to set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..window.protocol import Collective, StopTraining
from .agreed import AgreedMeter, smallest
from .loop import MakeBatch, NothingFitsError, ProbeResult, probe_micro_batches
from .meters import CpuMeter, Meter, all_live_tensor_bytes, format_bytes
from .plan import Plan, forward_breakpoints
from .preserve import modes_and_rng_preserved
from .probe import plan_from_result

SCRATCH = ".hf_accum_probe_state"  # under output_dir: the engine's state while the probe runs, removed after


def probe_through_engine(
    trainer,
    *,
    collective: Collective,
    train_step: Callable[[dict[str, Any]], Any],
    make_batch: MakeBatch,
    seq_len: int,
    budget_bytes: int,
    meter: Meter,
    budget_names: str,
    max_micro_batch: int | None,
    log: Callable[[str], None],
) -> tuple[ProbeResult, Plan]:
    """Probe the live engine at ``seq_len`` (``train_step(batch)``: one real step through it, at the boundary) and
    plan ``target_batch_size`` over the world; the engine, the model's modes and the RNG are left as they were."""
    args = trainer.args
    world = collective.world
    per_rank = args.target_batch_size // world
    cap = per_rank if max_micro_batch is None else min(per_rank, max_micro_batch)
    seam = trainer.engine
    engine = seam.label
    if isinstance(meter, CpuMeter) and meter.resident is None:
        meter = CpuMeter(resident=all_live_tensor_bytes)  # the profiler sees no tensor allocated before a step
    budget, limit = smallest(collective, budget_bytes, meter.capacity_bytes() - meter.unavailable_bytes())
    state, buckets, element = _model_and_buffers(trainer.model, seam)
    fit_one = None
    if buffers_dominate(limit, state, buckets, element):  # an OOM at micro-batch 1 is then most likely theirs
        fit_one = (f"DeepSpeed's own communication buffers ({_sizes(buckets)} elements of {element} bytes) could "
                   f"take half of the memory this process can use, the model's weights, gradients and optimizer "
                   f"state far less: set smaller ones in the DeepSpeed config's \"zero_optimization\"")
    agreed = AgreedMeter(meter, collective, engine, budget_names, fit_one)
    log(f"probing through {engine} at length {seq_len} (budget {format_bytes(budget)} on every rank)")

    def step_fn(micro: int) -> None:  # a window of one micro-batch, as the engine is told
        seam.set_live_batch(micro, 1)
        train_step(make_batch(micro))

    try:
        with seam.state_restored(os.path.join(args.output_dir, SCRATCH)), \
                modes_and_rng_preserved(trainer.model):
            result = probe_micro_batches(step_fn, agreed, budget, cap, must_resolve=forward_breakpoints(per_rank),
                                         optimize=args.auto_tune_optimize, limit_bytes=limit, log=log)
    except StopTraining:
        raise
    except Exception as exc:
        reason = collective.peer_stop()
        if reason is None:
            raise
        raise StopTraining(f"{reason} on another rank (this rank's pending collective failed as that rank left)") from exc
    result.extra.update({"seq_len": seq_len, "engine": engine})
    try:
        return result, plan_from_result(result, args.target_batch_size, world)
    except NothingFitsError as exc:
        first = next((t for t in result.trials if t.micro_batch_size == 1 and t.peak_bytes is not None), None)
        need = None if first is None else (first.reserved_bytes or first.peak_bytes)
        if need is None or not buffers_dominate(need, state, buckets, element):
            raise
        raise NothingFitsError(buffers_message(engine, need, result.budget_bytes, state, buckets, element),
                               result) from exc


# --- when DeepSpeed's own buffers, not the model, are what does not fit -----------------------------------------
def _model_and_buffers(model, engine) -> tuple[int, dict[str, int], int]:
    """The model's state bytes, the engine's bucket sizes (elements) and the element size its gradients use."""
    params = list(model.parameters())
    element = max((p.element_size() for p in params if p.requires_grad), default=4)
    return model_state_bytes(params), engine.buffers(), element


def _sizes(buckets: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in buckets.items())


def model_state_bytes(params) -> int:
    """What the model itself holds through a step, unpartitioned: its weights, a gradient of every trainable
    weight and AdamW's two float32 moments (the most ZeRO's partitions of them can add up to on one rank)."""
    total = 0
    for p in params:
        numel = getattr(p, "ds_numel", None) or p.numel()  # ZeRO-3 leaves an empty tensor in the module
        total += numel * p.element_size() + (numel * (p.element_size() + 8) if p.requires_grad else 0)
    return total


def buffers_dominate(need_bytes: int, state_bytes: int, buckets: dict[str, int], element_size: int) -> bool:
    """Whether micro-batch 1 fails to fit because of DeepSpeed's communication buffers rather than the model: the
    largest configured bucket could hold at least half of the measured step, and the model's weights, gradients and
    optimizer state are less than half of it (so checkpointing or LoRA, which shrink the rest, cannot help much)."""
    largest = max(buckets.values(), default=0) * element_size
    return need_bytes > 0 and largest >= need_bytes / 2 and state_bytes < need_bytes / 2


def buffers_message(engine: str, need_bytes: int, budget_bytes: int, state_bytes: int, buckets: dict[str, int],
                    element_size: int) -> str:
    sizes = _sizes(buckets)
    smaller = max(10 ** max(0, len(str(budget_bytes // 10 // element_size)) - 1), 1)  # a tenth of the budget
    return (
        f"even micro-batch 1 does not fit: one training step through {engine} needs {format_bytes(need_bytes)} against a "
        f"budget of {format_bytes(budget_bytes)}, and the model's weights, gradients and optimizer state are only "
        f"{format_bytes(state_bytes)}: the rest is mostly DeepSpeed's own communication buffers ({sizes} elements of "
        f"{element_size} bytes; DeepSpeed's defaults where not set). Set them in the DeepSpeed config's "
        f'"zero_optimization" (e.g. ' + ", ".join(f'"{k}": {smaller}' for k in buckets) + "), or raise the "
        "memory budget; gradient checkpointing or LoRA would not shrink them."
    )
