"""Section 9, loss kernels: benchmarks/bench_loss_kernels.py on this device, the tuner's pick against the sweep's fastest."""

from __future__ import annotations

import os
import sys
from typing import Any

from .context import Ctx
from .data import goal


def section_loss_kernels(ctx: Ctx) -> dict[str, Any]:
    """benchmarks/bench_loss_kernels.py on this device: every loss kernel that runs here x chunk sizes (CUDA: micro
    4 x seq 2048, vocab 128256, bf16; --quick: its CPU shape, smaller), peak and time relative to the unfused loss,
    and the tuner's pick against the sweep's fastest. Liger and Cut Cross-Entropy fill their rows where installed."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/bench_loss_kernels.py
    import bench_loss_kernels

    device = "cuda" if ctx.cuda else "cpu"
    shape = None if ctx.cuda or not ctx.quick else {"seq": 128, "hidden": 64, "vocab": 4096, "rows": (64, 256)}
    out = bench_loss_kernels.run(device, repeats=2 if ctx.quick else 3, shape=shape)
    print(bench_loss_kernels.table(out), flush=True)
    ratio = out["pick_vs_fastest"]
    return {"figures": out, "goals": [goal("tuner's loss kernel over the sweep's fastest (one loss step)", ratio,
                                           "<= 1.05", ratio <= 1.05)]}
