"""Run under `torchrun --nproc_per_node 2`: micro_batching="tokens" under DDP. Each rank's window has other lengths,
so its own fewest forwards differ; the ranks agree on the maximum and run equally many. Saves per rank the recorded
gradients, weights, windows and the number of forwards per window. Arguments: OUT and the kinds of batch to run in
turn, "padded" (padded rows) and/or "flat" (DataCollatorWithFlattening), each saved under OUT/KIND."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    out, rank = sys.argv[1], int(os.environ["RANK"])
    for kind in sys.argv[2:]:
        run(os.path.join(out, kind), rank, kind)


def run(out, rank, kind):
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from tests.exactness import StepRecorder, pad_collate, recording, tiny_llama
    from tests.window.test_token_budget import long_tailed

    os.makedirs(out, exist_ok=True)
    if kind == "flat":
        from transformers import DataCollatorWithFlattening

        collate = DataCollatorWithFlattening()
    else:
        collate = pad_collate
    model = tiny_llama()
    args = AccumTrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, target_batch_size=16,
        auto_tune=False, micro_batching="tokens", max_tokens_per_forward=120, max_steps=3, learning_rate=1e-2,
        max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        remove_unused_columns=False, ddp_backend="gloo", logging_steps=1,
    )
    recorder = StepRecorder()
    trainer = recording(AccumTrainer)(model=model, args=args, train_dataset=long_tailed(48), data_collator=collate,
                                      callbacks=[recorder])
    trainer.remove_callback(PrinterCallback)
    forwards = []
    model.register_forward_pre_hook(lambda m, a: forwards.append(1) if m.training else None)
    per_window = []
    trainer.add_callback(type("Count", (PrinterCallback,), {
        "on_step_end": lambda self, *a, **k: per_window.append(len(forwards) - sum(per_window)),
        "on_log": lambda self, *a, **k: None})())
    trainer.train()
    own = [trainer._engine.cutter.forwards_under(w[0], 120) for w in trainer.windows]
    torch.save({"grads": recorder.grads, "weights": recorder.weights, "windows": trainer.windows,
                "forwards": per_window, "own_fewest": own}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
