"""Exactness of transformers' Trainer vs AccumTrainer on every case, and AccumTrainer's step-time overhead.

    python benchmarks/bench_exactness.py            # both tables (~3 min on 2 CPU cores)
    python benchmarks/bench_exactness.py --skip-ddp # without the two-rank torchrun cases

Table 1: max over optimizer steps of the relative gradient error against one pass over the whole effective batch
(float64, padded variable-length micro-batches, micro 3 x accumulation 4, last window shorter), and the relative
error of the logged loss. Table 2: steady-state seconds per optimizer step, AccumTrainer / Trainer, same micro-batch
and accumulation, runs interleaved in one process so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from hf_accum import AccumTrainer, AccumTrainingArguments  # noqa: E402
from tests.exactness import CASES, lm_examples, pad_collate, run_case, tiny_llama  # noqa: E402


def exactness_rows(skip_ddp: bool):
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            errs = []
            for cls in (Trainer, AccumTrainer):
                if cls is Trainer and case.normalization == "samples":
                    pass  # Trainer has no "samples" mode: it runs its default, which is what users get
                err, logged, ref, _ = run_case(case, cls, os.path.join(tmp, name + cls.__name__))
                loss_err = max(abs(a - b) / abs(b) for a, b in zip(logged, ref))
                errs.append((err, loss_err))
            rows.append((name, *errs[0], *errs[1]))
        if not skip_ddp:
            from tests.integrations.test_ddp import RUNS, check_run, launch_two_ranks

            for trainer in ("plain", "accum"):
                out = os.path.join(tmp, "ddp_" + trainer)
                os.makedirs(out)
                launch_two_ranks(out, RUNS, trainer=trainer)
                for run in RUNS:
                    ranks, _, err, ref = check_run(out, run)
                    loss_err = max(abs(a - b) / abs(b) for a, b in zip(ranks[0]["losses"], ref.losses))
                    label = f"ddp2_{run.split(':')[0]}_avg{run.split(':')[1]}"
                    if trainer == "plain":
                        rows.append([label, err, loss_err])
                    else:
                        next(r for r in rows if r[0] == label).extend([err, loss_err])
    return rows


class StepTimer(TrainerCallback):
    def __init__(self):
        self.stamps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def step_seconds(cls, steps: int, micro: int, accum: int, seq: int) -> float:
    torch.manual_seed(0)
    model = tiny_llama(torch.float32, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=seq + 8)
    data = lm_examples(steps * micro * accum, seed=0, min_len=seq // 2, max_len=seq)
    argcls = AccumTrainingArguments if cls is AccumTrainer else TrainingArguments
    with tempfile.TemporaryDirectory() as tmp:
        args = argcls(output_dir=tmp, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                      max_steps=steps, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                      logging_steps=10**6, remove_unused_columns=False, dataloader_drop_last=True)
        timer = StepTimer()
        trainer = cls(model=model, args=args, train_dataset=data, data_collator=pad_collate, callbacks=[timer])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    gaps = [b - a for a, b in zip(timer.stamps[1:], timer.stamps[2:])]  # drop the first two steps: warm-up
    return statistics.median(gaps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--overhead-rounds", type=int, default=5)
    parser.add_argument("--skip-exactness", action="store_true")
    opts = parser.parse_args()

    print("## Exactness (float64): relative error vs one pass over the whole effective batch\n")
    print("| case | Trainer grad | Trainer loss | AccumTrainer grad | AccumTrainer loss |")
    print("|---|---|---|---|---|")
    for name, tg, tl, ag, al in ([] if opts.skip_exactness else exactness_rows(opts.skip_ddp)):
        print(f"| {name} | {tg:.2e} | {tl:.2e} | {ag:.2e} | {al:.2e} |")

    print("\n## Overhead: median seconds per optimizer step (Llama 4x256, seq<=256, micro 4 x accumulation 2)\n")
    ratios = []
    print("| round | Trainer s/step | AccumTrainer s/step | ratio |")
    print("|---|---|---|---|")
    for r in range(opts.overhead_rounds):
        plain = step_seconds(Trainer, steps=10, micro=4, accum=2, seq=256)
        ours = step_seconds(AccumTrainer, steps=10, micro=4, accum=2, seq=256)
        ratios.append(ours / plain)
        print(f"| {r} | {plain:.3f} | {ours:.3f} | {ours / plain:.3f} |")
    print(f"\nmedian ratio AccumTrainer / Trainer: {statistics.median(ratios):.3f} (goal <= 1.02)")


if __name__ == "__main__":
    main()
