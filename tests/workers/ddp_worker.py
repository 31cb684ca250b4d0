"""Run under `torchrun --nproc_per_node 2`: trains each requested case with two gloo ranks on CPU and saves,
per rank, the recorded gradients, weights, micro-batches and logged losses for the test to check."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.exactness import CASES, ForwardSizes, StepRecorder, logged_losses, pad_collate, recording  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--trainer", default="accum", choices=["accum", "plain"])
    parser.add_argument("runs", nargs="+", help="CASE:avg_tokens[:uneven], e.g. causal_lm:1")
    opts = parser.parse_args()
    from transformers import Trainer, TrainingArguments

    from hf_accum import AccumTrainer, AccumTrainingArguments

    rank = int(os.environ["RANK"])
    for run in opts.runs:
        name, avg, *mode = run.split(":")
        case = CASES[name]
        model = case.model()
        # uneven: the tuner plans target 14 (7 per rank) where 3 fit: 3 forwards of 2, 2, 3 per window (the probe
        # unseeded: the estimate only says where the search starts; ddp_tune_worker.py probes seeded on two ranks)
        batch = (dict(target_batch_size=14, probe_max_micro_batch=3, probe_from_estimate=False) if mode == ["uneven"]
                 else dict(per_device_train_batch_size=3, gradient_accumulation_steps=2))
        kwargs = dict(
            output_dir=os.path.join(opts.out, run.replace(":", "_")), **batch, num_train_epochs=1, learning_rate=1e-2, max_grad_norm=0.0,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
            remove_unused_columns=False, ddp_backend="gloo", average_tokens_across_devices=avg == "1", **case.args,
        )
        if opts.trainer == "accum":
            base, args = AccumTrainer, AccumTrainingArguments(loss_normalization=case.normalization, **kwargs)
        else:
            base, args = Trainer, TrainingArguments(**kwargs)
        cls = recording(base if case.mixin is None else type("User", (case.mixin, base), {}))
        recorder, forwards = StepRecorder(), ForwardSizes(model)
        trainer = cls(model=model, args=args, train_dataset=case.data(), data_collator=pad_collate,
                      callbacks=[recorder, forwards], **case.trainer_kwargs)
        trainer.train()
        torch.save(
            {"grads": recorder.grads, "weights": recorder.weights, "windows": trainer.windows,
             "losses": logged_losses(trainer), "avg_flag_after": trainer.args.average_tokens_across_devices,
             "fused": getattr(trainer, "fused_loss_active", None), "forwards": forwards.sizes,
             "plan": trainer.plan.to_dict() if trainer.plan else None},
            os.path.join(opts.out, f"{run.replace(':', '_')}.rank{rank}.pt"),
        )


if __name__ == "__main__":
    main()
