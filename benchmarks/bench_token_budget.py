"""micro_batching "samples" vs "tokens" on long-tailed lengths, side by side (CPU).

Data (fixed): 2048 examples, lengths lognormal (median 60, sigma 1.0) clipped to [8, 512], seed 0, and every 256th
example at 512; target 64 (one rank); the budget at which "samples" fits 4 worst-case rows: 4 x 512 tokens.

Part 1 (pure, every window of one epoch in the sampler's order): forwards per optimizer step and padded/real
tokens for "samples" (micro 4, each micro-batch padded to its longest), "tokens" (padded rows sorted and cut
under the budget) and "tokens" on padding-free rows. Part 2 (a tiny float64 Llama, the first 3 windows): both
modes trained through AccumTrainer from the same weights: CPU seconds per optimizer step and the largest relative
difference of their gradients.

    python benchmarks/bench_token_budget.py
"""

import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hf_accum.token_budget import partition_packed, partition_padded  # noqa: E402

TARGET, MICRO, LONGEST = 64, 4, 512
BUDGET = MICRO * LONGEST


def lengths(n=2048, seed=0):
    g = random.Random(seed)
    out = [min(512, max(8, round(math.exp(math.log(60) + g.gauss(0, 1.0))))) for _ in range(n)]
    for i in range(0, n, 256):
        out[i] = 512
    return out


def part1():
    lens = lengths()
    order = list(range(len(lens)))
    random.Random(1).shuffle(order)
    windows = [[lens[i] for i in order[w:w + TARGET]] for w in range(0, len(order), TARGET)]
    real = sum(lens)
    s_fwd = s_pad = t_fwd = t_pad = f_fwd = 0
    for w in windows:
        for m in range(0, len(w), MICRO):
            chunk = w[m:m + MICRO]
            s_fwd += 1
            s_pad += len(chunk) * max(chunk)
        groups = partition_padded(w, BUDGET)
        t_fwd += len(groups)
        t_pad += sum(len(g) * max(w[i] for i in g) for g in groups)
        f_fwd += len(partition_packed(w, BUDGET))
    steps = len(windows)
    rows = [("samples (micro 4)", s_fwd / steps, s_pad / real), ("tokens, padded rows", t_fwd / steps, t_pad / real),
            ("tokens, padding-free", f_fwd / steps, 1.0)]
    print(f"Part 1: {len(lens)} examples, {steps} optimizer steps of {TARGET}, budget {BUDGET} tokens per forward")
    print(f"{'mode':24} {'forwards/step':>14} {'padded/real':>12} {'forwards vs samples':>20}")
    for name, fwd, pad in rows:
        print(f"{name:24} {fwd:14.2f} {pad:12.3f} {fwd / rows[0][1]:20.3f}")


def part2():
    import tempfile

    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from tests.exactness import StepRecorder, max_relative_error, pad_collate, tiny_llama

    g = random.Random(2)
    lens = lengths(3 * TARGET, seed=3)
    data = []
    for n in lens:
        ids = [g.randint(1, 96) for _ in range(n)]
        data.append({"input_ids": ids, "labels": [-100] * (n // 4) + ids[n // 4:]})
    results = {}
    for mode in ("samples", "tokens"):
        with tempfile.TemporaryDirectory() as out:
            args = AccumTrainingArguments(
                output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=TARGET // MICRO,
                target_batch_size=TARGET, auto_tune=False, micro_batching=mode,
                max_tokens_per_forward=BUDGET if mode == "tokens" else None, max_steps=3, learning_rate=1e-3,
                max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                remove_unused_columns=False)
            recorder = StepRecorder()
            trainer = AccumTrainer(model=tiny_llama(max_position_embeddings=512), args=args, train_dataset=data,
                                   data_collator=pad_collate, callbacks=[recorder])
            trainer.remove_callback(PrinterCallback)
            start = time.process_time()
            trainer.train()
            results[mode] = (recorder, (time.process_time() - start) / 3)
    err = max_relative_error(results["tokens"][0].grads, results["samples"][0].grads)
    ratio = results["tokens"][1] / results["samples"][1]
    print(f"\nPart 2: tiny float64 Llama, 3 optimizer steps of {TARGET}")
    print(f"CPU s/step: samples {results['samples'][1]:.2f}, tokens {results['tokens'][1]:.2f} (ratio {ratio:.2f})")
    print(f"gradients, tokens vs samples: max relative difference {err:.2e}")


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    part1()
    part2()
