"""The probe's choice of a loss kernel: one step at the planned micro-batch with each kernel that runs on the device,
timed (one warm step, unprofiled) and measured (peak), and the fastest that fits the budget (`base.choose`).
Nothing is timed on paper (the estimate's fake tensors take no time) or when the kernel is pinned. In
``micro_batching="tokens"`` the planner pins each `candidates` kernel in turn (`pinned`) and chooses by whole steps
(planning/token_kernels.py), so this forward-level choice is "samples" mode's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from ..levers.kernels import base


def measure_kernels(model: torch.nn.Module, step_fn: Callable[[int], None], meter, budget_bytes: int, micro: int,
                    autocast: bool, log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """The plan's ``loss_kernel`` record, or None where there is nothing to choose (no fused-loss patch, a pinned
    kernel, one kernel runs here, or a meter that takes no time)."""
    from ..levers.kernels.fused_loss import installed_patch

    names = candidates(model, meter, autocast)
    if not names:
        return None
    patch = installed_patch(model)
    seconds, peaks = {}, {}
    try:
        for name in names:
            patch.kernel = name
            step_fn(micro)  # warm: the kernel's first call (and the allocator) is not the steady step
            peaks[name] = meter.measure(lambda: step_fn(micro), micro_batch_size=micro).peak_bytes
            seconds[name] = meter.time(lambda: step_fn(micro), micro_batch_size=micro)
    finally:
        patch.kernel = None
    seconds, peaks = agree(names, seconds, peaks)
    # chosen from the times as the plan records them (microseconds): times within a microsecond are a tie, which
    # `choose` gives to the earlier-registered kernel, so the record's own times name the kernel it holds
    seconds = {n: round(seconds[n], 6) for n in names}
    chosen = base.choose({n: (seconds[n], peaks[n]) for n in names}, budget_bytes, names[0])
    if log is not None:
        timed = ", ".join(f"{n} {seconds[n]:.3g} s ({peaks[n] / 2**20:.0f} MiB)" for n in names)
        log(f"loss kernel {chosen}: the fastest that fits at micro-batch {micro} ({timed} per step)")
    return {"kernel": chosen, "micro_batch_size": micro, "seconds": seconds,
            "peak_bytes": peaks}


def candidates(model: torch.nn.Module, meter, autocast: bool) -> list[str]:
    """The loss kernels the probe may choose between, in registration order: every kernel that runs on the fused
    loss's device and dtype, where there are two or more and none is pinned (no fused-loss patch, a pinned or forced
    kernel, or a meter that takes no time: none)."""
    from ..levers.kernels import fused_loss
    from ..levers.kernels.fused_loss import installed_patch

    patch = installed_patch(model)
    if patch is None or patch.kernel is not None or meter.name == "estimate" or fused_loss.IMPLEMENTATION != "auto":
        return []
    weight = patch.model.get_output_embeddings().weight
    names = base.runnable(weight.device.type, weight.dtype, autocast)
    return names if len(names) >= 2 else []


@contextlib.contextmanager
def pinned(model: torch.nn.Module, kernel: str | None):
    """The loss kernel ``kernel`` in force for as long as the block runs, as a pin is (the probe then times no other);
    None, or no fused-loss patch: as it is."""
    from ..levers.kernels.fused_loss import installed_patch

    patch = installed_patch(model) if kernel else None
    if patch is None:
        yield
        return
    before, patch.kernel = patch.kernel, kernel
    try:
        yield
    finally:
        patch.kernel = before


def agree(names: list[str], seconds: dict[str, float], peaks: dict[str, int]) -> tuple[dict, dict]:
    """Every rank's measurements made one: a data-parallel step lasts as long as its slowest rank and holds its
    largest peak, so each kernel's seconds and peak become the MAX over ranks, and all ranks choose the same kernel
    (the same ranks run the same kernels: the same device and dtype). Unchanged without torch.distributed."""
    from .loop import _dist_device, _distributed

    if not _distributed():
        return seconds, peaks
    import torch.distributed as dist

    t = torch.tensor([seconds[n] for n in names] + [float(peaks[n]) for n in names], dtype=torch.float64,
                     device=_dist_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    values = t.tolist()
    return dict(zip(names, values[:len(names)])), {n: int(v) for n, v in zip(names, values[len(names):])}
