"""Our probe vs the batch-size searches people use today, all driven by one meter on a CPU Llama.

    python benchmarks/bench_probe.py                 # 8 configurations x 3 budgets (~2-3 min on 2 CPU cores)
    python benchmarks/bench_probe.py --json out.json # also write every row

Each configuration (full fine-tune / LoRA, gradient checkpointing off / on, sequence 128 / 512) of a small
Llama built from config is measured once per micro-batch size with the real CpuMeter (a warm-up step first),
from 1 up to the first size over the largest budget; the strategies are then replayed against that cache,
so they see identical numbers.  A size over the budget counts as an out-of-memory error; sizes beyond the
measured range are over every budget (memory grows with the micro-batch; the scan checks it does).

Budgets are 1.6x, 3.7x and 9.5x each configuration's peak at micro-batch 1, so every configuration is
searched in a tight, a middling and a roomy budget.  The target batch is 64 (the search's cap).

Strategies (all start after the same warm-up, which no one is charged for):
  ours     hf_accum.probe.probe_micro_batches with the plan's divisors of 64 to resolve
  halve    halve on OOM from the target (64, 32, 16, ...), as accelerate's find_executable_batch_size did
  x0.9     multiply by 0.9 on OOM from the target, as accelerate / transformers' auto_find_batch_size now do
  binsrch  Lightning's BatchSizeFinder(mode="binsearch"): from 2, double until OOM, then bisect
           (one step per trial here; Lightning's default is 3, which would triple its sample-steps)
  exhaust  every size from 1 up to the first that does not fit: the true maximum

Figures: trials (steps measured), sample-steps (sum of the micro-batch sizes run, OOMs included), wall
time (the cached step times of the trials run; an OOM trial is charged a whole step at its size, time
extrapolated linearly past the measured range) and found max / true max.  The table shows ours in
absolute numbers and every other strategy as a ratio to ours.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_accum.meters import CpuMeter, Measurement, Meter, live_tensor_bytes  # noqa: E402
from hf_accum.plan import divisors  # noqa: E402
from hf_accum.probe import make_step_fn, probe_micro_batches, random_token_batch  # noqa: E402

TARGET = 64
BUDGET_FACTORS = (1.6, 3.7, 9.5)
MiB = 1 << 20


# --- the model and its configurations ------------------------------------------------------------------
def small_llama() -> LlamaForCausalLM:
    """Layer activations dominate (as in real LLMs), so checkpointing and LoRA change the curve."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).float()


@dataclass
class Config:
    lora: bool
    checkpointing: bool
    seq_len: int

    @property
    def name(self) -> str:
        return f"{'lora' if self.lora else 'full'}{'+ckpt' if self.checkpointing else ''} s{self.seq_len}"

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = small_llama()
        if self.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        return model, opt


CONFIGS = [Config(lora, ckpt, seq) for seq in (128, 512) for lora in (False, True) for ckpt in (False, True)]


# --- the measured curve, and a meter that replays it ---------------------------------------------------------
@dataclass
class Curve:
    """One configuration's measurements at micro-batch 1..len; ``limit``: the first size over the largest
    budget (all larger sizes are over every budget)."""

    measurements: dict[int, Measurement] = field(default_factory=dict)
    seconds_model: tuple[float, float] = (0.0, 0.0)
    scan_seconds: float = 0.0
    monotone: bool = True

    def peak(self, micro: int) -> float:
        return self.measurements[micro].peak_bytes if micro in self.measurements else math.inf

    def seconds(self, micro: int) -> float:
        if micro in self.measurements:
            return self.measurements[micro].seconds
        c, d = self.seconds_model
        return c + d * micro


def measure_curve(config: Config, stop_factor: float) -> Curve:
    model, opt = config.build()
    step = make_step_fn(model, opt, random_token_batch(model, config.seq_len))
    meter = CpuMeter(resident=lambda: live_tensor_bytes(model, opt))
    start = time.perf_counter()
    step(1)  # warm-up: the optimizer state
    curve = Curve()
    micro = 1
    while micro <= TARGET:
        m = meter.measure(lambda micro=micro: step(micro))
        curve.measurements[micro] = m
        if m.peak_bytes > stop_factor * curve.measurements[1].peak_bytes:
            break
        micro += 1
    curve.scan_seconds = time.perf_counter() - start
    peaks = [curve.measurements[m].peak_bytes for m in sorted(curve.measurements)]
    curve.monotone = all(a <= b for a, b in zip(peaks, peaks[1:]))
    xs = sorted(curve.measurements)[-4:]
    if len(xs) >= 2:  # step time past the measured range, for the OOM trials of the strategies from 64
        ys = [curve.measurements[x].seconds for x in xs]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        d = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        curve.seconds_model = (my - d * mx, d)
    return curve


class ReplayMeter(Meter):
    """The cached measurement of a size, or an out-of-memory error when it is over the budget."""

    name = "replay"

    def __init__(self, curve: Curve, budget: float) -> None:
        self.curve, self.budget = curve, budget
        self.log: list[tuple[int, bool]] = []  # (micro, fitted) in the order run

    def measure(self, fn: Callable[[], object], *, micro_batch_size: int | None = None) -> Measurement:
        fits = self.curve.peak(micro_batch_size) <= self.budget
        self.log.append((micro_batch_size, fits))
        if not fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (replayed): micro-batch {micro_batch_size}")
        return self.curve.measurements[micro_batch_size]

    def time(self, fn: Callable[[], object], *, micro_batch_size: int | None = None) -> float:
        return 0.0  # the warm-up, which no strategy is charged for

    def capacity_bytes(self) -> int:
        return int(self.budget)


# --- the strategies: each returns the found maximum; the meter's log holds what it ran ----------------------
def ours(meter: ReplayMeter) -> int:
    result = probe_micro_batches(lambda micro: None, meter, int(meter.budget), TARGET, must_resolve=divisors(TARGET))
    return result.max_micro_batch_size


def _fits(meter: ReplayMeter, micro: int) -> bool:
    try:
        meter.measure(lambda: None, micro_batch_size=micro)
    except torch.OutOfMemoryError:
        return False
    return True


def halve(meter: ReplayMeter) -> int:
    size = TARGET
    while size >= 1:
        if _fits(meter, size):
            return size
        size //= 2
    return 0


def decay(meter: ReplayMeter) -> int:
    size = TARGET
    while size >= 1:
        if _fits(meter, size):
            return size
        size = int(size * 0.9)
    return 0


def lightning_binsearch(meter: ReplayMeter, init_val: int = 2, max_trials: int = 25) -> int:
    """lightning.pytorch.tuner.batch_size_scaling._run_binary_scaling, one step per trial; the target plays
    the dataset length (Lightning stops doubling there).  Lightning returns the last midpoint even when it
    was never run; a returned size that does not fit counts as nothing found."""
    low, high, size, count = 1, None, min(init_val, TARGET), 0
    while True:
        if _fits(meter, size):
            count += 1
            if count > max_trials:
                break
            low = size
            if high:
                if high - low <= 1:
                    break
                size = (high + low) // 2
            else:
                if size >= TARGET:
                    break
                size = min(2 * size, TARGET)
        else:
            high = size
            size = (high + low) // 2
            if high - low <= 1:
                break
    return size if meter.curve.peak(size) <= meter.budget else 0


def exhaustive(meter: ReplayMeter) -> int:
    size = 1
    while size <= TARGET and _fits(meter, size):
        size += 1
    return size - 1


STRATEGIES = {"ours": ours, "halve": halve, "x0.9": decay, "binsrch": lightning_binsearch, "exhaust": exhaustive}


# --- the run ---------------------------------------------------------------------------------------------------
def run_strategy(curve: Curve, budget: float, strategy: Callable[[ReplayMeter], int]) -> dict:
    meter = ReplayMeter(curve, budget)
    found = strategy(meter)
    return {
        "trials": len(meter.log),
        "sample_steps": sum(m for m, _ in meter.log),
        "seconds": sum(curve.seconds(m) for m, _ in meter.log),
        "found": found,
        "sizes": [m for m, _ in meter.log],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    rows = []
    for config in CONFIGS:
        curve = measure_curve(config, max(BUDGET_FACTORS))
        p1 = curve.measurements[1].peak_bytes
        print(
            f"# {config.name}: measured micro 1..{max(curve.measurements)} in {curve.scan_seconds:.1f} s, "
            f"peak(1) {p1 / MiB:.1f} MiB, monotone={curve.monotone}",
            flush=True,
        )
        for factor in BUDGET_FACTORS:
            budget = factor * p1
            results = {name: run_strategy(curve, budget, fn) for name, fn in STRATEGIES.items()}
            rows.append({"config": config.name, "factor": factor, "budget_bytes": budget, **results})

    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _ratio(a: float, b: float) -> str:
    return "-" if b == 0 else f"{a / b:.2f}"


def print_table(rows: list[dict]) -> None:
    others = [s for s in STRATEGIES if s != "ours"]
    head = f"{'config':<16}{'budget':>8}{'true':>5} | {'ours: trials':>12}{'steps':>6}{'sec':>7}{'found':>6}"
    for s in others:
        head += f" | {s + ': trials×':>15}{'steps×':>7}{'sec×':>6}{'found':>6}"
    print()
    print("Found max as found/true; other strategies' trials, sample-steps and seconds as ratios to ours.")
    print(head)
    print("-" * len(head))
    for r in rows:
        true = r["exhaust"]["found"]
        o = r["ours"]
        line = (
            f"{r['config']:<16}{r['budget_bytes'] / MiB:>7.0f}M{true:>5} | {o['trials']:>12}{o['sample_steps']:>6}"
            f"{o['seconds']:>7.2f}{_ratio(o['found'], true):>6}"
        )
        for s in others:
            x = r[s]
            line += (
                f" | {_ratio(x['trials'], o['trials']):>15}{_ratio(x['sample_steps'], o['sample_steps']):>7}"
                f"{_ratio(x['seconds'], o['seconds']):>6}{_ratio(x['found'], true):>6}"
            )
        print(line)
    print("-" * len(head))

    def gmean(values: list[float]) -> float:
        values = [v for v in values if v > 0]
        return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")

    summary = f"{'geo-mean / mean':<29} | {statistics.fmean(r['ours']['trials'] for r in rows):>12.2f}"
    summary += f"{statistics.fmean(r['ours']['sample_steps'] for r in rows):>6.0f}"
    summary += f"{statistics.fmean(r['ours']['seconds'] for r in rows):>7.2f}"
    summary += f"{min(r['ours']['found'] / r['exhaust']['found'] for r in rows if r['exhaust']['found']):>6.2f}"
    for s in others:
        trials = gmean([r[s]["trials"] / r["ours"]["trials"] for r in rows])
        steps = gmean([r[s]["sample_steps"] / r["ours"]["sample_steps"] for r in rows])
        secs = gmean([r[s]["seconds"] / r["ours"]["seconds"] for r in rows])
        found = min(r[s]["found"] / r["exhaust"]["found"] for r in rows if r["exhaust"]["found"])
        summary += f" | {trials:>15.2f}{steps:>7.2f}{secs:>6.2f}{found:>6.2f}"
    print(summary)
    print("(ours: mean trials, sample-steps and seconds, and the worst found/true; others: geometric means of the")
    print(" ratios to ours and their worst found/true.  'exhaust' found/true is 1 by definition.)")
    ours_trials = [r["ours"]["trials"] for r in rows]
    print(f"ours: {statistics.fmean(ours_trials):.2f} trials on average (max {max(ours_trials)}), found/true >= "
          f"{min(r['ours']['found'] / r['exhaust']['found'] for r in rows if r['exhaust']['found']):.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
