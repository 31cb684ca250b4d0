"""The fastest exact way to the target (CPU): any target cut into the fewest forwards, side by side with the
divisor plan transformers' shape forces.

Part A: targets 24..64 (one rank) at a memory budget where 7 rows fit. The budget is set halfway between the
meter's peaks of real training steps of 7 and 8 rows (a small float32 Llama, rows of 256 tokens, the last row of
a step shorter so that it is padded as training's are); AccumTrainer's probe must find 7 there. For every target:
forwards per optimizer step of the divisor plan (the largest divisor of the target that fits, as hf_accum planned
before) and of the uneven cut (goal: ceil(target / 7)). For the targets in MEASURED both plans train 3 optimizer
steps from the same weights: forwards counted by a hook on the model, CPU seconds per optimizer step (median of
the steps after the first, over 2 interleaved rounds), and the uneven run's peak against the budget by the meter.

    python benchmarks/bench_plan.py                 # about 8 minutes on 2 idle CPU cores
"""

import copy
import math
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from hf_accum import AccumTrainer, AccumTrainingArguments  # noqa: E402
from hf_accum.probing.meters import CpuMeter, live_tensor_bytes  # noqa: E402
from hf_accum.probing.plan import divisors, plan_batch  # noqa: E402

LENGTH, FITS = 256, 7
TARGETS = range(24, 65)
MEASURED = (24, 29, 31, 37, 41, 47, 53, 61, 64)
ROUNDS = 2


def rows(n, seed=0, last_shorter=True):
    g = random.Random(seed)
    out = []
    for r in range(n):
        length = LENGTH - LENGTH // 4 if last_shorter and r == n - 1 and n > 1 else LENGTH
        ids = [g.randint(1, 250) for _ in range(length)]
        out.append({"input_ids": ids, "labels": [-100] * (length // 4) + ids[length // 4:]})
    return out


class StepClock(TrainerCallback):
    """Forwards per optimizer step (a pre-hook on the model) and the seconds of each step."""

    def __init__(self, model):
        self.forwards, self.seconds, self._on, self._n, self._t = [], [], False, 0, 0.0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self._on and module.training:
            self._n += 1

    def on_train_begin(self, args, state, control, **kwargs):
        self._on = True

    def on_step_begin(self, args, state, control, **kwargs):
        self._n, self._t = 0, time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._t)
        self.forwards.append(self._n)


def train(initial, data, out, steps, **batch):
    from tests.exactness import pad_collate

    args = AccumTrainingArguments(output_dir=out, max_steps=steps, learning_rate=1e-4, report_to=[],
                                  save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                                  remove_unused_columns=False, **batch)
    model = copy.deepcopy(initial)
    clock = StepClock(model)
    trainer = AccumTrainer(model=model, args=args, train_dataset=data, data_collator=pad_collate, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)
    return trainer, clock


def step_peak(initial, n):
    """The meter's peak of plain training (the plan given, no probe) on n rows, 2 optimizer steps of one forward."""
    with tempfile.TemporaryDirectory() as out:
        trainer, _ = train(initial, rows(n), out, 2, per_device_train_batch_size=n, gradient_accumulation_steps=1,
                           target_batch_size=n, auto_tune=False)
        meter = CpuMeter(resident=lambda model=trainer.model: live_tensor_bytes(model))
        return meter.measure(trainer.train).peak_bytes


def divisor_micro(target, fits):
    return max(d for d in divisors(target) if d <= fits)


def main():
    from benchmarks.bench_probe import small_llama

    torch.set_num_threads(1)
    initial = small_llama()
    budget = (step_peak(initial, FITS) + step_peak(initial, FITS + 1)) // 2
    print(f"Part A: small float32 Llama, rows of {LENGTH} tokens, memory budget {budget / 2**20:.1f} MiB (halfway "
          f"between real steps of {FITS} and {FITS + 1} rows)\n")
    print(f"{'target':>6} {'divisor plan':>22} {'uneven plan':>40} {'fwd div':>7} {'fwd uneven':>10} "
          f"{'ceil(t/7)':>9}")
    misses = 0
    for t in TARGETS:
        d = divisor_micro(t, FITS)
        uneven = plan_batch(t, 1, FITS)
        misses += uneven.forwards != math.ceil(t / FITS)
        print(f"{t:6} {f'micro {d} x accumulation {t // d}':>22} {uneven.describe():>40} {t // d:7} "
              f"{uneven.forwards:10} {math.ceil(t / FITS):9}")
    print(f"\nforwards = ceil(target / {FITS}) for {len(TARGETS) - misses} of {len(TARGETS)} targets (planner)\n")

    data = rows(64 * 3, seed=1, last_shorter=False)
    print(f"{'target':>6} {'probe max':>9} {'fwd/step div':>12} {'fwd/step uneven':>15} {'s/step div':>10} "
          f"{'s/step uneven':>13} {'uneven/div':>10} {'peak/budget':>11}")
    ratios = []
    for t in MEASURED:
        d = divisor_micro(t, FITS)
        seconds = {"divisor": [], "uneven": []}
        for _ in range(ROUNDS):  # interleaved, so that a busy moment of the machine hits both plans alike
            with tempfile.TemporaryDirectory() as out:
                plain, clock_d = train(initial, data, out, 3, per_device_train_batch_size=d,
                                       gradient_accumulation_steps=t // d, target_batch_size=t, auto_tune=False)
                plain.train()
                seconds["divisor"] += clock_d.seconds[1:]
            with tempfile.TemporaryDirectory() as out:
                tuned, clock_u = train(initial, data, out, 3, target_batch_size=t, memory_budget_bytes=budget)
                tuned.tune()
                meter = CpuMeter(resident=lambda model=tuned.model: live_tensor_bytes(model))
                peak = meter.measure(tuned.train).peak_bytes
                seconds["uneven"] += clock_u.seconds[1:]
        s_d, s_u = statistics.median(seconds["divisor"]), statistics.median(seconds["uneven"])
        ratios.append(s_u / s_d)
        print(f"{t:6} {tuned.probe_result.max_micro_batch_size:9} {statistics.mean(clock_d.forwards):12.1f} "
              f"{statistics.mean(clock_u.forwards):15.1f} {s_d:10.3f} {s_u:13.3f} {s_u / s_d:10.2f} "
              f"{peak / budget:11.3f}")
    print(f"\nseconds per optimizer step, uneven / divisor: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {len(MEASURED)} targets")


if __name__ == "__main__":
    main()
