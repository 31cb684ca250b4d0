"""Section 7, estimate: the estimate (fake tensors) beside the measured peaks."""

from __future__ import annotations

import time
from typing import Any

import torch

from hf_accum.probing.probe import make_step_fn, random_token_batch

from .context import LORA_MODULES, Ctx, _mib, release
from .data import goal


# --- section 7: the estimate beside the measurement ------------------------------------------------------------
def estimate_builder(ctx: Ctx, method: str):
    """The section's model as `Ctx.method_model` builds it, for the estimate to build on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        model = LlamaForCausalLM(LlamaConfig(**ctx.s.model)).to(ctx.dtype)
        if method == "full":
            return model
        from peft import LoraConfig

        from hf_accum.probing.loading import add_lora

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_MODULES, task_type="CAUSAL_LM")
        return add_lora(model, lora, checkpointing=True)

    return build


def measured_peaks(ctx: Ctx, method: str, seq: int, sizes: tuple[int, ...]) -> dict[int, tuple[int, int | None]]:
    """(peak allocated, peak reserved) of one real step at each size, after a warm-up step (None: out of memory)."""
    model = ctx.method_model(method)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    step = make_step_fn(model, opt, random_token_batch(model, seq))
    out: dict[int, tuple[int, int | None]] = {}
    try:
        step(1)
        for micro in sizes:
            try:
                m = ctx.meter(model, opt).measure(lambda micro=micro: step(micro))
            except torch.OutOfMemoryError:
                break
            out[micro] = (m.peak_bytes, m.reserved_bytes)
    finally:
        opt.state.clear()
        release(model, opt)
    return out


def section_estimate(ctx: Ctx) -> dict[str, Any]:
    """`hf-accum probe --estimate` (fake tensors, nothing allocated) against the meter at the same sizes: CUDA's
    peak reserved and allocated on a GPU, the CPU meter's peak under --quick (there the estimate is for "cpu")."""
    from hf_accum.probing.estimate import estimate_peaks

    sizes = (1, 2) if ctx.quick else (1, 2, 4)
    device = "cuda" if ctx.cuda else "cpu"
    rows, worst = [], []
    for method in ("lora", "full"):
        for seq in ctx.s.seqs:
            if ctx.clock.out():
                break
            start = time.perf_counter()
            predicted = estimate_peaks(estimate_builder(ctx, method), sizes, seq_len=seq, device=device)
            seconds = time.perf_counter() - start
            for micro, (allocated, reserved) in measured_peaks(ctx, method, seq, sizes).items():
                charged = reserved if reserved is not None else allocated
                error = predicted[micro] / charged - 1
                worst.append(abs(error))
                rows.append({"method": method, "seq": seq, "micro": micro, "estimate_bytes": predicted[micro],
                             "max_allocated_bytes": allocated, "max_reserved_bytes": reserved,
                             "error_vs_reserved" if reserved is not None else "error_vs_peak": error,
                             "estimate_seconds": seconds})
                print(f"  {method} seq {seq} micro {micro}: estimate {_mib(predicted[micro])}, allocated "
                      f"{_mib(allocated)}, reserved {_mib(reserved)}, error {error:+.1%}", flush=True)
    figures = {"rows": rows, "device_estimated": device}
    against = "reserved" if ctx.cuda else "CPU meter's peak"
    bound = 0.10 if ctx.cuda else 0.05
    value = max(worst) if worst else None
    goals = [goal(f"worst |estimate / {against} - 1|", value, f"<= {bound:.0%}",
                  value <= bound if value is not None else None)]
    return {"figures": figures, "goals": goals}
