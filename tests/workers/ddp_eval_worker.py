"""Run under `torchrun --nproc_per_node 2`: evaluates one float64 GPT-2 on the same data at several eval batch
sizes with two gloo ranks, through AccumTrainer and through transformers' Trainer, and saves the eval_loss each
gave (rank 0) for tests/window/test_evaluation.py to check against its single-process reference."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.window.test_evaluation import N_EVAL, eval_data, eval_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("batches", nargs="+", type=int)
    opts = parser.parse_args()
    import torch
    from transformers import Trainer, TrainingArguments

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from tests.exactness import pad_collate, sum_over_items_loss

    class Gathering(AccumTrainer):
        """Like TRL's trainers: compute_loss runs a collective, so every rank must run as many forwards."""

        collectives_in_compute_loss = True

        def compute_loss(self, model, inputs, *args, **kwargs):
            torch.distributed.all_reduce(torch.ones(1))
            return super().compute_loss(model, inputs, *args, **kwargs)

    results = {}
    for name, cls, args_cls in (("accum", AccumTrainer, AccumTrainingArguments), ("transformers", Trainer,
                                                                                  TrainingArguments),
                                ("collective", Gathering, AccumTrainingArguments)):
        for b in opts.batches:
            args = args_cls(output_dir=os.path.join(opts.out, f"{name}{b}"), per_device_eval_batch_size=b,
                            report_to=[], use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
                            ddp_backend="gloo")
            trainer = cls(model=eval_model(), args=args, eval_dataset=eval_data(), data_collator=pad_collate,
                          compute_loss_func=sum_over_items_loss)
            results[f"{name}:{b}"] = trainer.evaluate()["eval_loss"]
    # rank 1 alone runs out of memory at its first evaluation forward: it re-runs that batch in halves by itself
    from tests.trainer.test_oom_recovery import OOMAt

    args = AccumTrainingArguments(output_dir=os.path.join(opts.out, "oom"), per_device_eval_batch_size=8,
                                  report_to=[], use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
                                  ddp_backend="gloo")
    model = eval_model()
    trainer = AccumTrainer(model=model, args=args, eval_dataset=eval_data(), data_collator=pad_collate,
                           compute_loss_func=sum_over_items_loss)
    injector = OOMAt(model, [1] if int(os.environ["RANK"]) == 1 else [], training=False)
    results["oom:8"] = trainer.evaluate()["eval_loss"]
    if int(os.environ["RANK"]) == 1:
        with open(os.path.join(opts.out, "oom_forwards_rank1.json"), "w") as f:
            json.dump(injector.count, f)
    # auto_eval_batch_size: rank 1 is made to fit at most 3 (as a rank with less free memory would); all take 3
    from hf_accum.planning import eval_batch

    rank = int(os.environ["RANK"])
    if rank == 1:
        search = eval_batch.largest_fitting
        eval_batch.largest_fitting = lambda fits, upper: search(fits, min(upper, 3))
    args = AccumTrainingArguments(output_dir=os.path.join(opts.out, "auto"), auto_eval_batch_size=True,
                                  memory_budget_bytes=256 * 2**20, report_to=[], use_cpu=True, disable_tqdm=True,
                                  remove_unused_columns=False, ddp_backend="gloo")
    trainer = AccumTrainer(model=eval_model(), args=args, eval_dataset=eval_data(), data_collator=pad_collate,
                           compute_loss_func=sum_over_items_loss)
    results["auto"] = trainer.evaluate()["eval_loss"]
    with open(os.path.join(opts.out, f"auto_batch_rank{rank}.json"), "w") as f:
        json.dump(trainer.args.per_device_eval_batch_size, f)
    if rank == 0:
        with open(os.path.join(opts.out, "eval_loss.json"), "w") as f:
            json.dump({"n": N_EVAL, **results}, f)


if __name__ == "__main__":
    main()
