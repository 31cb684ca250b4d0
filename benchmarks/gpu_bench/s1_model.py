"""Section 1, model: a Llama from config in bf16 (no hub): parameters, build time, weights' memory, one training step's loss."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from hf_accum.probing import flops
from hf_accum.probing.meters import live_tensor_bytes
from hf_accum.probing.probe import make_step_fn, random_token_batch

from .context import Ctx, release
from .data import goal


# --- section 1: the model ------------------------------------------------------------------------------------------
def section_model(ctx: Ctx) -> dict[str, Any]:
    ctx.reset_peak()
    start = time.perf_counter()
    model = ctx.llama()
    ctx.sync()
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    weights = live_tensor_bytes(model, device_type=ctx.device.type)
    losses = []

    def forward(m, batch):
        loss = m(**batch).loss
        losses.append(float(loss.detach()))
        return loss

    step = make_step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-5), random_token_batch(model, 128),
                        forward=forward)
    start = time.perf_counter()
    step(1)
    ctx.sync()
    step_s = time.perf_counter() - start
    figures = {
        "config": dict(ctx.s.model), "dtype": str(ctx.dtype), "device": str(ctx.device), "parameters": params,
        "linear_parameters": flops.linear_parameters(model), "build_seconds": build_s, "weights_bytes": weights,
        "first_step_seconds_micro1_seq128": step_s, "first_step_loss": losses[0] if losses else None,
        "peak_reserved_bytes": ctx.peak_reserved(),
        "flops_per_token_seq2048": flops.training_flops_per_token(model, 2048),
    }
    release(model)
    ok = bool(losses) and math.isfinite(losses[0])
    return {"figures": figures, "goals": [goal("first step loss is finite", figures["first_step_loss"], "finite", ok)]}
