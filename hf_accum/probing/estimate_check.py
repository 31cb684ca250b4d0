"""The estimate beside the probe's measurement, like for like on CPU (tests and benchmarks/bench_estimate.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .estimate import Estimate, checkpoint_lever, classification_batch, estimate_model
from .probe import probe_model


@dataclass(frozen=True)
class Row:
    micro: int
    measured: int
    estimated: int

    @property
    def error(self) -> float:
        return self.estimated / self.measured - 1


def against_probe(build, *, seq_len: int, target_batch_size: int, budget_bytes: int,
                  bf16: bool = False, checkpoint_layers: str | int | None = None,
                  task: str = "causal_lm", all_peaks: bool = True) -> tuple[list[Row], int, int, Estimate]:
    """Estimate ``build()`` for CPU, then probe it for real (CpuMeter) with the same budget. Returns a row per size
    the probe measured, the probe's largest fitting micro-batch and the estimate's, and the estimate.
    ``checkpoint_layers`` ("all" or k): that level set on both, as the estimate sets it. ``task``
    "classification": both run batches of one label per sample (the estimate's own batch, on real tensors).
    ``all_peaks=False``: the estimate steps only the sizes its search ran and the probe measured."""
    autocast = torch.bfloat16 if bf16 else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build()
    if checkpoint_layers is not None:
        checkpoint_lever(model, checkpoint_layers)
    make_batch = classification_batch(model, seq_len) if task == "classification" else None
    result, _plan = probe_model(model, seq_len=seq_len, target_batch_size=target_batch_size,
                                budget_bytes=budget_bytes, autocast_dtype=autocast, make_batch=make_batch)
    measured = {t.micro_batch_size: t.peak_bytes for t in result.measured_trials if t.peak_bytes}
    del model
    est = estimate_model(build, seq_len=seq_len, target_batch_size=target_batch_size, device="cpu",
                         device_memory=64 * 2**30, budget_bytes=budget_bytes, bf16=bf16, also=tuple(measured),
                         checkpoint_layers=checkpoint_layers, task=task, all_peaks=all_peaks)
    rows = [Row(m, peak, est.peaks[m]) for m, peak in sorted(measured.items())]
    return rows, result.max_micro_batch_size, est.result.max_micro_batch_size, est
