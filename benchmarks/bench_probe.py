"""Our probe vs the batch-size searches people use today, all driven by one meter on a CPU Llama.

    python benchmarks/bench_probe.py                 # 8 configurations x 3 budgets (a few minutes on 2 CPU cores)
    python benchmarks/bench_probe.py --json out.json # also write every row
    python benchmarks/bench_probe.py --only s512     # the configurations whose name contains "s512"

Each configuration (full fine-tune / LoRA, gradient checkpointing off / on, sequence 128 / 512, plus a full
fine-tune at sequence 16, where the optimizer step's peak bends the curve at small micro-batches) of a small
Llama built from config runs real steps (AdamW with foreach=True, as on CUDA) through the real CpuMeter after
one warm-up step, each micro-batch size at most once (a cache per configuration and size); the strategies
are replayed against that cache, so they all see identical numbers.  A size over the budget counts as an
out-of-memory error.  Sizes whose fate memory's monotonicity already settles are not run (the script checks
the measured peaks are monotone), which keeps the whole run to a few minutes on 2 CPU cores.

Budgets are 1.6x, 3.7x and 9.5x each configuration's peak at micro-batch 1: a tight, a middling and a roomy
budget for every configuration.  The target batch is 64 (the search's cap).

Strategies (all start after the same warm-up, which no one is charged for):
  ours     hf_accum.probing.probe.probe_micro_batches with the plan's divisors of 64 to resolve
  halve    halve on OOM from the target (64, 32, 16, ...), as accelerate's find_executable_batch_size did
  x0.9     multiply by 0.9 on OOM from the target, as accelerate / transformers' auto_find_batch_size now do
  binsrch  Lightning's BatchSizeFinder(mode="binsearch"): from 2, double until OOM, then bisect
           (one step per trial here; Lightning's default is 3, which would triple its sample-steps)
  exhaust  every size from 1 up to the first that does not fit: the true maximum
  ours+est ours started from the estimate (hf_accum.probing.paper: the same configuration on fake tensors, the same
           budget, AdamW foreach): its predicted largest fit first, then the size beside it (`--no-estimate`: skip)

Figures: trials (steps run), sample-steps (sum of the micro-batch sizes run, OOMs included), wall time
(step seconds from a robust line through the measured step times -- each the faster of two unprofiled runs
-- since single timings on a shared machine are noisy; an OOM trial is charged a whole step at its size)
and found max / true max.  The table shows ours
in absolute numbers and every other strategy as a ratio to ours.
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
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_accum.probing.loop import probe_micro_batches  # noqa: E402
from hf_accum.probing.meters import CpuMeter, Measurement, Meter, live_tensor_bytes  # noqa: E402
from hf_accum.probing.plan import divisors  # noqa: E402
from hf_accum.probing.probe import make_step_fn, random_token_batch  # noqa: E402

TARGET = 64
BUDGET_FACTORS = (1.6, 3.7, 9.5)
MiB = 1 << 20


# --- the model and its configurations ------------------------------------------------------------------
def small_llama() -> LlamaForCausalLM:
    """Layer activations dominate (as in real LLMs, unlike a toy whose logits dominate), so checkpointing
    and LoRA change the curve; small enough that a step at micro-batch 18 x 512 tokens takes ~1 s on CPU."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
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
        model = self.model()
        # foreach=True, the CUDA default (CPU defaults to a per-tensor loop): its step allocates temporaries
        # the size of the parameters, the fixed peak that bends real curves at small micro-batches
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
        return model, opt

    def model(self) -> torch.nn.Module:
        model = small_llama()
        if self.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        return model


CONFIGS = [Config(lora, ckpt, seq) for seq in (128, 512) for lora in (False, True) for ckpt in (False, True)]
# A short sequence, where the optimizer step's fixed peak (foreach temporaries) dominates micro-batches 1-2:
# the bend the search has to get past.
CONFIGS.append(Config(lora=False, checkpointing=False, seq_len=16))


# --- the measured curve, and a meter that replays it ---------------------------------------------------------
class Curve:
    """One configuration's step, measured lazily and at most once per micro-batch size.

    Whether a size fits a budget is read off the cache when memory's monotonicity settles it (a smaller
    size over the budget, or a larger one within it); only otherwise is the size measured.  So sizes far
    over every budget (x0.9 and halving start at 64) are never run, and the scan stays short.
    """

    def __init__(self, config: Config) -> None:
        self.model, self.opt = config.build()
        self.step = make_step_fn(self.model, self.opt, random_token_batch(self.model, config.seq_len))
        self.meter = CpuMeter(resident=lambda: live_tensor_bytes(self.model, self.opt))
        self.step(1)  # warm-up: the optimizer state
        self.meter.measure(lambda: self.step(1))  # and the profiler's first session, slow once per process
        self.measurements: dict[int, Measurement] = {}
        self.step_seconds: dict[int, float] = {}
        self.measuring_seconds = 0.0

    def measure(self, micro: int) -> Measurement:
        if micro not in self.measurements:
            start = time.perf_counter()
            self.measurements[micro] = self.meter.measure(lambda: self.step(micro))
            # the step time: the faster of two runs without the profiler (noise on a shared machine only
            # ever adds time, and a training step runs unprofiled)
            self.step_seconds[micro] = min(self.meter.time(lambda: self.step(micro)) for _ in range(2))
            self.measuring_seconds += time.perf_counter() - start
        return self.measurements[micro]

    def fits(self, micro: int, budget: float) -> bool:
        if any(m <= micro and x.peak_bytes > budget for m, x in self.measurements.items()):
            return False
        if any(m >= micro and x.peak_bytes <= budget for m, x in self.measurements.items()):
            return True
        return self.measure(micro).peak_bytes <= budget

    def true_max(self, budget: float, guess: int) -> int:
        """The largest size that fits ('exhaust' in the table): gallop from ``guess`` (ours' answer, run
        first) until the answer is bracketed, then bisect.  The guess only saves measurements: the answer
        is the size measured (or settled) to fit next to one measured (or settled) not to."""
        if not self.fits(1, budget):
            return 0
        lo, hi = 1, TARGET + 1  # lo fits, hi does not
        guess, step = min(max(guess, 1), TARGET), 1
        if self.fits(guess, budget):
            lo = guess
            while lo + step < hi and self.fits(lo + step, budget):
                lo, step = lo + step, 2 * step
            hi = min(hi, lo + step)
        else:
            hi = guess
            while hi - step > lo and not self.fits(hi - step, budget):
                hi, step = hi - step, 2 * step
            lo = max(lo, hi - step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid, budget) else (lo, mid)
        return lo

    @property
    def monotone(self) -> bool:
        peaks = [self.measurements[m].peak_bytes for m in sorted(self.measurements)]
        return all(a <= b for a, b in zip(peaks, peaks[1:]))

    def seconds(self, micro: int) -> float:
        """Step seconds from a Theil-Sen line through every measured (micro, seconds): single timings on a
        shared 2-core machine are noisy, and an OOM trial past the measured range needs a value anyway.
        A step never gets cheaper with more samples, so a negative slope (noise) falls back to time
        proportional to the micro-batch."""
        points = sorted(self.step_seconds.items())
        slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1 :]]
        d = statistics.median(slopes) if slopes else 0.0
        if d <= 0:
            return micro * statistics.median(y / x for x, y in points)
        c = statistics.median(y - d * x for x, y in points)
        return max(c + d * micro, d * micro)


class ReplayMeter(Meter):
    """The cached measurement of a size, or an out-of-memory error when it is over the budget."""

    name = "replay"

    def __init__(self, curve: Curve, budget: float) -> None:
        self.curve, self.budget = curve, budget
        self.log: list[tuple[int, bool]] = []  # (micro, fitted) in the order run

    def measure(self, fn: Callable[[], object], *, micro_batch_size: int | None = None) -> Measurement:
        fits = self.curve.fits(micro_batch_size, self.budget)
        self.log.append((micro_batch_size, fits))
        if not fits:
            raise torch.OutOfMemoryError(f"CUDA out of memory (replayed): micro-batch {micro_batch_size}")
        return self.curve.measure(micro_batch_size)

    def time(self, fn: Callable[[], object], *, micro_batch_size: int | None = None) -> float:
        return 0.0  # the warm-up, which no strategy is charged for

    def capacity_bytes(self) -> int:
        return int(self.budget)


# --- the strategies: each returns the found maximum; the meter's log holds what it ran ----------------------
def ours(meter: ReplayMeter) -> int:
    result = probe_micro_batches(lambda micro: None, meter, int(meter.budget), TARGET, must_resolve=divisors(TARGET))
    return result.max_micro_batch_size


def seeded(seed: int) -> Callable[[ReplayMeter], int]:
    """Ours, its search started from ``seed`` (the estimate's largest fit)."""

    def strategy(meter: ReplayMeter) -> int:
        result = probe_micro_batches(lambda micro: None, meter, int(meter.budget), TARGET,
                                     must_resolve=divisors(TARGET), seed=seed)
        return result.max_micro_batch_size

    return strategy


def estimated_fit(config: Config, budget: float) -> tuple[int, float]:
    """The estimate's largest fit for ``config`` under ``budget`` (fake tensors, the bench's AdamW), its seconds."""
    from hf_accum.probing.estimate import estimate_model

    start = time.perf_counter()
    est = estimate_model(config.model, seq_len=config.seq_len, target_batch_size=TARGET, device="cpu",
                         device_memory=64 << 30, budget_bytes=int(budget), all_peaks=False,
                         optimizer={"foreach": True, "lr": 1e-4})
    return est.result.max_micro_batch_size, time.perf_counter() - start


def _fits(meter: ReplayMeter, micro: int) -> bool:
    fits = meter.curve.fits(micro, meter.budget)  # the others need no memory figures, only fit or OOM
    meter.log.append((micro, fits))
    return fits


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
    return size if meter.curve.fits(size, meter.budget) else 0


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
    parser.add_argument("--only", help="run the configurations whose name contains this (e.g. 's512')")
    parser.add_argument("--no-estimate", action="store_true", help="leave out ours+est (no estimates on fake tensors)")
    args = parser.parse_args(argv)

    rows = []
    for config in CONFIGS:
        if args.only and args.only not in config.name:
            continue
        curve = Curve(config)
        p1 = curve.measure(1).peak_bytes
        for factor in BUDGET_FACTORS:
            budget = factor * p1
            results = {"ours": run_strategy(curve, budget, ours)}
            # the truth next, so the other strategies' over-budget sizes are settled without a run
            curve.true_max(budget, guess=results["ours"]["found"])
            results.update({name: run_strategy(curve, budget, fn) for name, fn in STRATEGIES.items() if name != "ours"})
            if not args.no_estimate:
                seed, seconds = estimated_fit(config, budget)
                results["ours+est"] = {**run_strategy(curve, budget, seeded(seed)), "estimate": seed,
                                       "estimate_seconds": seconds}
            rows.append({"config": config.name, "factor": factor, "budget_bytes": budget, **results})
        print(
            f"# {config.name}: peak(1) {p1 / MiB:.1f} MiB, measured {len(curve.measurements)} sizes "
            f"{sorted(curve.measurements)} in {curve.measuring_seconds:.1f} s, monotone={curve.monotone}",
            flush=True,
        )
        del curve

    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _ratio(a: float, b: float) -> str:
    return "-" if b == 0 else f"{a / b:.2f}"


def print_table(rows: list[dict]) -> None:
    others = [s for s in STRATEGIES if s != "ours"] + (["ours+est"] if rows and "ours+est" in rows[0] else [])
    head = f"{'config':<16}{'budget':>8}{'true':>5} | {'ours: trials':>12}{'steps':>6}{'sec':>7}{'found':>6}"
    for s in others:
        head += f" | {s + ': trials×':>15}{'steps×':>8}{'sec×':>8}{'found':>6}"
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
                f" | {_ratio(x['trials'], o['trials']):>15}{_ratio(x['sample_steps'], o['sample_steps']):>8}"
                f"{_ratio(x['seconds'], o['seconds']):>8}{_ratio(x['found'], true):>6}"
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
        summary += f" | {trials:>15.2f}{steps:>8.2f}{secs:>8.2f}{found:>6.2f}"
    print(summary)
    print("(ours: mean trials, sample-steps and seconds, and the worst found/true; others: geometric means of the")
    print(" ratios to ours and their worst found/true.  'exhaust' found/true is 1 by definition.)")
    ours_trials = [r["ours"]["trials"] for r in rows]
    print(
        f"ours: {statistics.fmean(ours_trials):.2f} trials on average (max {max(ours_trials)}), found/true >= "
        f"{min(r['ours']['found'] / r['exhaust']['found'] for r in rows if r['exhaust']['found']):.3f}"
    )
    if "ours+est" in others:
        seeded_rows = [r["ours+est"] for r in rows]
        right = sum(r["ours+est"]["estimate"] == r["exhaust"]["found"] for r in rows)
        print(
            f"ours+est: {statistics.fmean(x['trials'] for x in seeded_rows):.2f} trials on average (max "
            f"{max(x['trials'] for x in seeded_rows)}), found/true >= "
            f"{min(r['ours+est']['found'] / r['exhaust']['found'] for r in rows if r['exhaust']['found']):.3f}; "
            f"the estimate named the true max in {right}/{len(rows)}, "
            f"{statistics.fmean(x['estimate_seconds'] for x in seeded_rows):.1f} s per estimate"
        )


if __name__ == "__main__":
    raise SystemExit(main())
