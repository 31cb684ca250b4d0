"""Issue 31: the level the tuner chooses (none / selective / full checkpointing per layer) vs an exhaustive sweep of
every layers-per-level combination, side by side in one run (CPU).

    python benchmarks/bench_checkpoint_levels.py                       # 4-layer tiny Llama, seq 256, target 16
    python benchmarks/bench_checkpoint_levels.py --layers 8 --seq-len 512 --target 32
    python benchmarks/bench_checkpoint_levels.py --lever checkpointing # the full-or-none lever alone (issue 24)

The budget is the peak of one step holding the whole target with every layer fully checkpointed (+2%), so no
checkpointing fits only a small micro-batch and full checkpointing the whole window. The sweep: every (full, selective)
pair with full + selective <= L (the first `full` layers fully checkpointed, the next `selective` selectively, the
rest not: the order the levers use), at each the largest fitting micro-batch by bisection on measured peaks (CpuMeter,
the probe's meter; not the probe's search), then the real time of one optimizer step at it (the fewest forwards: a
smaller micro-batch at the same level only adds forwards): ceil(target / micro) near-equal forwards and backwards, then
one AdamW step, the fastest of three runs in process CPU seconds (OMP_NUM_THREADS=1; wall time on a shared 2-core
machine varies 2x between runs; the probe itself times wall seconds). The tuner (`probe_model` with the lever's
levels: `levers.selective.Levels`, positions 0..2L, or `levers.checkpointing.Levels`) is timed the same way at its
choice, alternating with the sweep's best (three rounds, each side's fastest). Printed: the sweep table, the tuner's
choice, its time over the sweep's best (goal <= 1.05), its peak against the budget, and the probe's seconds over the
sweep's (goal <= 0.10).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from hf_accum.compat import gradient_checkpointing
from hf_accum.levers import checkpointing, selective
from hf_accum.probing.meters import CpuMeter, live_tensor_bytes
from hf_accum.probing.probe import make_step_fn, probe_model, random_token_batch
from hf_accum.tiny import build_model

KWARGS = {"use_reentrant": False}


def window_seconds(model, opt, make_batch, target: int, micro: int) -> float:
    forwards = math.ceil(target / micro)
    sizes = [target // forwards + (1 if i < target % forwards else 0) for i in range(forwards)]

    def window():
        model.train()
        for rows in sizes:
            loss = model(**make_batch(rows)).loss * rows / target
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    best = math.inf
    for _ in range(3):
        start = time.process_time()  # CPU seconds of this (single-threaded) process: steadier on a shared machine
        window()
        best = min(best, time.process_time() - start)
    return best


def largest_fit(meter, step_fn, budget: float, target: int) -> tuple[int, float | None]:
    lo, hi, peak_lo = 0, target + 1, None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        charged = meter.measure(lambda mid=mid: step_fn(mid), micro_batch_size=mid).charged_bytes
        if charged <= budget:
            lo, peak_lo = mid, charged
        else:
            hi = mid
    return lo, peak_lo


def sweep(model, opt, make_batch, meter, step_fn, budget, target, layers, lever):
    pairs = [(f, s) for f in range(layers + 1) for s in range(layers + 1 - f)]
    if lever == "checkpointing":
        pairs = [(f, 0) for f in range(layers + 1)]
    rows = []
    for full, sel in pairs:
        with selective.layer_levels(model, full, sel, KWARGS):
            micro, peak = largest_fit(meter, step_fn, budget, target)
            seconds = window_seconds(model, opt, make_batch, target, micro) if micro else math.inf
        rows.append((full, sel, micro, peak, seconds))
    return rows


def per_lever(model, opt, make_batch, meter, step_fn, micro, layers):
    """Each lever on every layer at one micro-batch (the no-checkpointing level's largest fit): peak and the time of one
    forward + backward + optimizer step (fastest of 3, CPU seconds), for the README's levers table."""
    out = []
    for name, full, sel in (("none", 0, 0), ("selective, every layer", 0, layers), ("full, every layer", layers, 0)):
        with selective.layer_levels(model, full, sel, KWARGS):
            peak = meter.measure(lambda: step_fn(micro), micro_batch_size=micro).charged_bytes
            seconds = window_seconds(model, opt, make_batch, micro, micro)
        out.append((name, peak, seconds))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--target", type=int, default=16)
    p.add_argument("--lever", choices=["selective", "checkpointing"], default="selective")
    a = p.parse_args()
    torch.manual_seed(0)
    model = build_model(num_layers=a.layers, hidden_size=a.hidden).float()
    L = len(gradient_checkpointing.checkpointable_layers(model))
    make_batch = random_token_batch(model, a.seq_len)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    meter = CpuMeter(resident=lambda: live_tensor_bytes(model, opt))
    step_fn = make_step_fn(model, opt, make_batch)
    step_fn(1)  # the optimizer's state, as the probe's warm-up
    with gradient_checkpointing.checkpointed_layers(model, L, KWARGS):
        budget = 1.02 * meter.measure(lambda: step_fn(a.target), micro_batch_size=a.target).charged_bytes

    sweep_start = time.perf_counter()
    rows = sweep(model, opt, make_batch, meter, step_fn, budget, a.target, L, a.lever)
    sweep_seconds = time.perf_counter() - sweep_start

    levels = selective.Levels(model, L, KWARGS) if a.lever == "selective" else checkpointing.Levels(model, L, KWARGS)
    probe_start = time.perf_counter()
    result, plan = probe_model(model, seq_len=a.seq_len, target_batch_size=a.target, budget_bytes=int(budget),
                               make_batch=make_batch, lever=levels, max_micro_batch=a.target)
    probe_seconds = time.perf_counter() - probe_start
    record = result.extra["checkpointing"]
    chosen, level = record["chosen"], record["plan_record"]
    full, sel = level.get("full", level.get("layers", 0)), level.get("selective", 0)
    with selective.layer_levels(model, full, sel, KWARGS):
        tuned_peak = meter.measure(lambda: step_fn(chosen["micro"]), micro_batch_size=chosen["micro"]).charged_bytes
    # the choice against the sweep's best, re-timed in alternation (the same point twice when they agree): the sweep's
    # own figure was taken a minute earlier, and the machine's speed drifts by more than the 5% the goal allows
    best = min(rows, key=lambda r: r[4])
    tuned = best_time = math.inf
    for _ in range(3):
        with selective.layer_levels(model, full, sel, KWARGS):
            tuned = min(tuned, window_seconds(model, opt, make_batch, a.target, chosen["micro"]))
        with selective.layer_levels(model, best[0], best[1], KWARGS):
            best_time = min(best_time, window_seconds(model, opt, make_batch, a.target, best[2]))
    report(a, L, budget, rows, best, (full, sel, chosen), tuned, best_time, tuned_peak, probe_seconds, sweep_seconds,
           len(result.measured_trials))
    micro = rows[0][2] or 1
    print(f"each lever on all {L} layers at micro {micro} (peak MiB, s per step; vs none):")
    base = None
    for name, peak, seconds in per_lever(model, opt, make_batch, meter, step_fn, micro, L):
        base = base or (peak, seconds)
        print(f"| {name} | {peak / 2**20:.1f} | {seconds:.3f} | {peak / base[0] - 1:+.0%} | {seconds / base[1] - 1:+.0%} |")


def report(a, L, budget, rows, best, choice, tuned, best_time, tuned_peak, probe_seconds, sweep_seconds, trials):
    mib = 2**20
    full, sel, chosen = choice
    print(f"tiny Llama, {L} layers, hidden {a.hidden}, seq {a.seq_len}, target {a.target}, budget {budget / mib:.1f} "
          f"MiB (CPU), lever {a.lever}")
    print("| full | selective | none | largest micro | forwards | peak MiB | s per optimizer step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for f, s, micro, peak, seconds in rows:
        forwards = math.ceil(a.target / micro) if micro else "-"
        print(f"| {f} | {s} | {L - f - s} | {micro} | {forwards} | {'-' if peak is None else f'{peak / mib:.1f}'} | "
              f"{seconds:.3f} |")
    same = [r for r in rows if (r[0], r[1], r[2]) == (full, sel, chosen["micro"])]
    print(f"the sweep's best: {best[0]} full + {best[1]} selective, micro {best[2]}; the tuner's choice is "
          + (f"a sweep row ({same[0][4]:.3f} s there)" if same else "not a sweep row"))
    print(f"tuner: {full} full + {sel} selective, {chosen['forwards']} forwards of <= {chosen['micro']} rows, "
          f"{tuned:.3f} s per optimizer step = {tuned / best_time:.3f} x the sweep's best ({best_time:.3f} s re-timed "
          f"alongside, goal <= 1.05); peak {tuned_peak / mib:.1f} MiB of {budget / mib:.1f} "
          f"({'within' if tuned_peak <= budget else 'OVER'} budget); probe {probe_seconds:.1f} s = "
          f"{probe_seconds / sweep_seconds:.3f} x the sweep's {sweep_seconds:.1f} s (goal <= 0.10), {trials} trials")


if __name__ == "__main__":
    main()
