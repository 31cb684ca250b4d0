"""eval_loss against the eval batch: transformers' Trainer vs AccumTrainer on the same model and data.

    python benchmarks/bench_eval.py          # ~1 min on 2 CPU cores

A float64 GPT-2 (so only the weighting differs, not rounding) evaluates 64 causal-LM examples whose prompt
(label -100) and target lengths vary as SFT data does, at every eval batch 1..16. The reference is the token mean
by hand: each example forwarded alone, float64 cross-entropy of its counted labels after the causal shift.
Printed: each batch's eval_loss from both trainers, their error against the reference, the spread (max - min) over
the 16 batch sizes, and the evaluation seconds of both (run interleaved, so machine noise hits both alike).

Then `auto_eval_batch_size` (a float32 Llama, logits kept for compute_metrics, 256 examples up to 120 tokens): for
budgets that fit 4, 16 and 64 rows of the longest example, the eval batch chosen against the largest that fits
(every size measured the same way, one by one), and the seconds of an evaluation at the chosen batch against 1.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from hf_accum import AccumTrainer, AccumTrainingArguments  # noqa: E402
from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2  # noqa: E402
from tests.window.test_evaluation import reference  # noqa: E402

N, BATCHES = 64, range(1, 17)


def evaluate(cls, args_cls, model, data, b, out):
    args = args_cls(output_dir=out, per_device_eval_batch_size=b, report_to=[], use_cpu=True, disable_tqdm=True,
                    remove_unused_columns=False)
    trainer = cls(model=model, args=args, eval_dataset=data, data_collator=pad_collate,
                  compute_loss_func=sum_over_items_loss)  # a float64 loss: transformers' own casts to float32
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    loss = trainer.evaluate()["eval_loss"]
    return loss, time.perf_counter() - start


def main():
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    data = lm_examples(N, seed=11, min_len=4, max_len=120)
    model = tiny_gpt2()
    want = reference(model, data)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for b in BATCHES:
            theirs, t_theirs = evaluate(Trainer, TrainingArguments, model, data, b, tmp)
            ours, t_ours = evaluate(AccumTrainer, AccumTrainingArguments, model, data, b, tmp)
            rows.append((b, theirs, ours, t_theirs, t_ours))
    print(f"reference token mean (each example alone, float64 by hand): {want:.15f}\n")
    print("| eval batch | Trainer eval_loss | Trainer - reference | AccumTrainer eval_loss | AccumTrainer - reference "
          "| Trainer s | AccumTrainer s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b, theirs, ours, t_theirs, t_ours in rows:
        print(f"| {b} | {theirs:.10f} | {theirs - want:+.2e} | {ours:.10f} | {ours - want:+.2e} | {t_theirs:.3f} "
              f"| {t_ours:.3f} |")
    spread = [max(r[i] for r in rows) - min(r[i] for r in rows) for i in (1, 2)]
    worst = [max(abs(r[i] - want) for r in rows) for i in (1, 2)]
    seconds = [sum(r[i] for r in rows) for i in (3, 4)]
    print(f"\nspread over eval batches {BATCHES.start}..{BATCHES.stop - 1}: Trainer {spread[0]:.2e}, "
          f"AccumTrainer {spread[1]:.2e}")
    print(f"worst |eval_loss - reference|: Trainer {worst[0]:.2e}, AccumTrainer {worst[1]:.2e}")
    print(f"evaluation seconds, all 16 batch sizes: Trainer {seconds[0]:.2f}, AccumTrainer {seconds[1]:.2f} "
          f"(ratio {seconds[1] / seconds[0]:.2f})")


def auto_rows():
    from hf_accum.probing.meters import CpuMeter, live_tensor_bytes
    from tests.exactness import tiny_llama

    data = lm_examples(256, seed=12, min_len=4, max_len=120)
    model = tiny_llama(torch.float32, hidden_size=64, intermediate_size=128)
    longest = max(data, key=lambda e: len(e["input_ids"]))
    probe = Trainer(model=model, args=TrainingArguments(output_dir="unused", report_to=[], use_cpu=True))
    meter = CpuMeter(resident=lambda: live_tensor_bytes(model))
    model.eval()
    peaks = {}
    with torch.no_grad():
        for b in range(1, 129):
            batch, held = pad_collate([longest] * b), []
            m = meter.measure(lambda batch=batch, held=held: held.append(Trainer.prediction_step(probe, model, batch,
                                                                                                   False)))
            peaks[b] = m.peak_bytes + m.rounding_bytes
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fits in (4, 16, 64):
            budget = (peaks[fits] + peaks[fits + 1]) // 2
            largest = max(b for b, p in peaks.items() if p <= budget)
            times = {}
            for auto, size in ((True, 1), (False, 1)):
                args = AccumTrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, disable_tqdm=True,
                                              remove_unused_columns=False, auto_eval_batch_size=auto,
                                              memory_budget_bytes=budget, per_device_eval_batch_size=size)
                trainer = AccumTrainer(model=model, args=args, eval_dataset=data, data_collator=pad_collate,
                                       compute_metrics=lambda p: {"rows": float(len(p.predictions))})
                trainer.remove_callback(PrinterCallback)
                if auto:
                    trainer.evaluate()  # the first evaluation measures and sets the eval batch
                    chosen = trainer.args.per_device_eval_batch_size
                start = time.perf_counter()
                trainer.evaluate()
                times[auto] = time.perf_counter() - start
            rows.append((fits, largest, chosen, times[True], times[False]))
    print("\n| budget fits | largest that fits | chosen | eval s at chosen | eval s at batch 1 | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for fits, largest, chosen, t_auto, t_one in rows:
        print(f"| {fits} rows | {largest} | {chosen} | {t_auto:.2f} | {t_one:.2f} | {t_one / t_auto:.1f}x |")


if __name__ == "__main__":
    main()
    auto_rows()
