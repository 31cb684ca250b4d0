"""Run under `torchrun --nproc_per_node 2`: rank 1's logits are NaN at forward 5 (step 3); both ranks must skip it."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.trainer.test_nonfinite import NaNAt  # noqa: E402


def main():
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    model = tiny_gpt2()
    args = AccumTrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, target_batch_size=8,
        auto_tune=False, max_steps=5, learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, remove_unused_columns=False, ddp_backend="gloo", logging_steps=1,
    )
    trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(48, seed=6), data_collator=pad_collate,
                           compute_loss_func=sum_over_items_loss)
    trainer.remove_callback(PrinterCallback)
    if rank == 1:
        NaNAt(model, [5])
    trainer.train()
    torch.save(trainer.model.state_dict(), os.path.join(out, f"final.rank{rank}.pt"))


if __name__ == "__main__":
    main()
