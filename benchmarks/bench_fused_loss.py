"""Fused causal-LM loss (hf_accum/levers/kernels/fused_loss.py) vs the model's own loss from the full logits, side by side, CPU.

    python benchmarks/bench_fused_loss.py              # vocab 32k and 128k (a few minutes on 2 CPU cores)
    python benchmarks/bench_fused_loss.py --vocab 32000

For each vocabulary, on a small Llama (hidden 256, 2 layers, sequence 256) built from config, float32, AdamW:
  peak     peak tensor memory of one training step above the resident weights/gradients/optimizer state, at the
           same micro-batch (hf_accum's CpuMeter: the profiler's allocation events replayed), and the whole peak;
  s/step   wall seconds of one step (forward, backward, optimizer): median of 3 rounds, each round one step of every
           mode back to back after a warm-up round (interleaved: a shared machine's load hits all alike); the
           ratio is the median of the per-round ratios;
  max mb   the largest micro-batch fitting one budget, as hf_accum's probe finds it (probe_model, cap 16); the
           budget is the unfused step's whole peak at the equal micro-batch, so the unfused maximum is about it;
  grad err float64 exactness: relative gradient error of the fused loss against cross-entropy computed by hand in
           float64 from the full logits (same weights, a padded batch with masked prompt tokens), fallback too.
Fused rows use the default implementation (torch's F.linear_cross_entropy where this torch has it) and, for peak and
time, the checkpointed-chunk fallback older torch gets ("fallback"). Ratios are fused / unfused.
Goals (issue 11): peak <= 0.5x at vocab >= 32k; max micro-batch >= 1.6x; time <= 1.1x; gradient error <= 1e-6.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import hf_accum.levers.kernels.fused_loss as fl  # noqa: E402
from hf_accum.probing.meters import CpuMeter, live_tensor_bytes  # noqa: E402
from hf_accum.probing.probe import make_step_fn, probe_model, random_token_batch  # noqa: E402

MiB = 1 << 20
SEQ = 256
MICRO = {32000: 4, 128000: 2}  # the equal micro-batches
CAP = 16  # the probe's largest micro-batch: 4x the unfused maximum at 32k, enough to show the goal of 1.6x


def llama(vocab: int, dtype=torch.float32, seq: int = SEQ) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq)
    return LlamaForCausalLM(cfg).to(dtype)


def _stepper(vocab: int, micro: int, mode: str):
    model = llama(vocab).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step = make_step_fn(model, opt, random_token_batch(model, SEQ))
    return model, opt, lambda: step(micro)


def step_peaks(vocab: int, micro: int, mode: str) -> dict:
    """Peak tensor memory of one training step above the resident state, and the whole peak."""
    model, opt, step = _stepper(vocab, micro, mode)
    meter = CpuMeter(resident=lambda: live_tensor_bytes(model, opt))
    with _fused(model, mode):
        step()  # warm-up: optimizer state and gradients exist from here on, as in training
        m = meter.measure(step)
    return {"above": m.peak_bytes - m.baseline_bytes, "peak": m.peak_bytes}


def step_seconds(vocab: int, micro: int, modes, rounds: int = 3) -> dict:
    """Seconds per step of each mode, interleaved (one step of each per round, after a warm-up of each) so that
    load from other processes on a shared machine hits all modes alike; the median ratio to unfused per mode."""
    steppers = {mode: _stepper(vocab, micro, mode) for mode in modes}
    times = {mode: [] for mode in modes}
    for r in range(rounds + 1):
        for mode, (model, _, step) in steppers.items():
            with _fused(model, mode):
                start = time.perf_counter()
                step()
                if r:  # round 0 warms up
                    times[mode].append(time.perf_counter() - start)
    out = {mode: statistics.median(t) for mode, t in times.items()}
    out["ratio"] = {mode: statistics.median(a / b for a, b in zip(times[mode], times["unfused"])) for mode in modes}
    return out


def largest_micro_batch(vocab: int, budget: int, mode: str) -> int:
    model = llama(vocab).train()
    with _fused(model, mode):
        result, _ = probe_model(model, seq_len=SEQ, target_batch_size=CAP, budget_bytes=budget, max_micro_batch=CAP)
    return result.max_micro_batch_size


def gradient_error(vocab: int, mode: str) -> float:
    """Fused gradient vs float64 cross-entropy by hand from the full logits, on a padded batch with a masked prompt."""
    model = llama(vocab, torch.float64, seq=64).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (3, 64), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :10] = -100  # a prompt
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits.double()
    y = labels[:, 1:]
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), y.reshape(-1), ignore_index=-100, reduction="sum")
    (ref / y.ne(-100).sum()).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with _fused(model, mode):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert out.logits is None  # the fused path ran
        out.loss.backward()
    num = sum(float((p.grad - want[n]).pow(2).sum()) for n, p in model.named_parameters())
    den = sum(float(w.pow(2).sum()) for w in want.values())
    return (num / den) ** 0.5


class _fused:
    """unfused: the model as is; fused: hf_accum's fused loss, default implementation; fallback: forced chunks."""

    def __init__(self, model, mode):
        self.model, self.mode = model, mode

    def __enter__(self):
        self.saved = fl.IMPLEMENTATION
        fl.IMPLEMENTATION = "chunked" if self.mode == "fallback" else "auto"
        self.patch = fl.patch_model(self.model) if self.mode != "unfused" else None

    def __exit__(self, *exc):
        if self.patch is not None:
            self.patch.remove()
        fl.IMPLEMENTATION = self.saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    opts = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    impl = fl.implementation_for(torch.zeros(1, 1), torch.zeros(1, 1)) if fl.IMPLEMENTATION == "auto" else fl.IMPLEMENTATION
    print(f"torch {torch.__version__}; fused default implementation for float32: {impl} "
          f"(rows per chunk: {', '.join(f'{v // 1000}k -> {fl.chunk_rows(v)}' for v in opts.vocab)})", flush=True)
    rows = []
    for vocab in opts.vocab:
        micro = MICRO.get(vocab, 2)
        figs = {mode: step_peaks(vocab, micro, mode) for mode in ("unfused", "fused", "fallback")}
        secs = step_seconds(vocab, micro, ("unfused", "fused", "fallback"))
        for mode in figs:
            figs[mode]["seconds"] = secs[mode]
        figs["ratio"] = secs["ratio"]
        print(f"  vocab {vocab}: steps measured", flush=True)
        budget = figs["unfused"]["peak"]
        maxes = {mode: largest_micro_batch(vocab, budget, mode) for mode in ("unfused", "fused")}
        print(f"  vocab {vocab}: probes done", flush=True)
        errors = {mode: gradient_error(vocab, mode) for mode in ("fused", "fallback")}
        rows.append((vocab, micro, figs, budget, maxes, errors))

    print()
    print("| vocab | micro | step peak above resident MiB: unfused / fused (ratio) [fallback ratio] "
          "| whole peak ratio | s/step: unfused / fused (ratio) [fallback ratio] "
          "| max micro at budget: unfused / fused (ratio) | float64 grad err: fused [fallback] |")
    print("|---|---|---|---|---|---|---|")
    for vocab, micro, f, budget, maxes, errors in rows:
        u, z, c = f["unfused"], f["fused"], f["fallback"]
        print(
            f"| {vocab // 1000}k | {micro} "
            f"| {u['above'] / MiB:.0f} / {z['above'] / MiB:.0f} ({z['above'] / u['above']:.2f}x) "
            f"[{c['above'] / u['above']:.2f}x] "
            f"| {z['peak'] / u['peak']:.2f}x "
            f"| {u['seconds']:.2f} / {z['seconds']:.2f} ({f['ratio']['fused']:.2f}x) "
            f"[{f['ratio']['fallback']:.2f}x] "
            f"| {maxes['unfused']} / {maxes['fused']}{' (cap)' if maxes['fused'] == CAP else ''} "
            f"({maxes['fused'] / max(1, maxes['unfused']):.2f}x) "
            f"at {budget / MiB:.0f} MiB "
            f"| {errors['fused']:.1e} [{errors['fallback']:.1e}] |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
