"""Run as one of two torchrun launches joined by c10d rendezvous (2 nodes x 2 ranks, gloo): float64 GPT-2, a
target of 16 planned by the probe under a memory budget and a cap of 2 rows (micro x accumulation x 4 ranks), each node with its own
output folder (OUT, no shared filesystem: `save_on_each_node=True`). Modes (argv: OUT MODE [N]):
- `stop N`: the global rank 3 (node 1's second rank) sends itself SIGTERM during optimizer step N; every rank
  finishes the same step, checkpoints into its node's folder and stops.
- `resume`: resume_from_checkpoint=True in the node's own folder, to the end.
Each rank writes OUT/MODE.rankR.pt: the plan, whether it probed, its micro-batches per optimizer step, the gradients
and weights before each step, and (resume) the final weights."""

import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from tests.exactness import StepRecorder, lm_examples, pad_collate, recording, sum_over_items_loss, tiny_gpt2  # noqa: E402

TARGET, STEPS, BUDGET, CAP = 16, 5, 6 * 2**20, 2  # the cap: fewer than target / world rows a forward, so accumulation


class SignalAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if args.process_index == 3 and state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step N runs, on one rank of the second node


def main():
    out, mode, *rest = sys.argv[1:]
    from hf_accum import AccumTrainer, AccumTrainingArguments

    args = AccumTrainingArguments(
        output_dir=out, target_batch_size=TARGET, memory_budget_bytes=BUDGET, probe_max_micro_batch=CAP,
        gradient_checkpointing=False,
        max_steps=STEPS, learning_rate=1e-2, max_grad_norm=0.0, report_to=[], save_strategy="no",
        save_on_each_node=True, use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False,
        ddp_backend="gloo", logging_steps=1)
    recorder = StepRecorder()
    callbacks = [recorder] + ([SignalAt(int(rest[0]))] if mode == "stop" else [])
    trainer = recording(AccumTrainer)(model=tiny_gpt2(), args=args, train_dataset=lm_examples(160, seed=6),
                                      data_collator=pad_collate, compute_loss_func=sum_over_items_loss,
                                      callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    rank = trainer.args.process_index

    def record(**extra):
        torch.save({"plan": trainer.plan.to_dict() if trainer.plan else None, "probed": trainer.probe_result is not None,
                    "windows": getattr(trainer, "windows", []), "grads": recorder.grads, "weights": recorder.weights,
                    "local_rank": trainer.args.local_process_index, **extra},
                   os.path.join(out, f"{mode}.rank{rank}.pt"))

    try:
        trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    except SystemExit:  # the stop (hf_accum's Preempted): what was trained before it is the record
        record(stopped_at=trainer.state.global_step)
        torch.distributed.barrier()  # the first rank to exit makes its torchrun end the others: all have written
        raise
    record(final={k: v.clone() for k, v in trainer.model.state_dict().items()})
    torch.distributed.destroy_process_group()  # left to interpreter exit, gloo's threads can abort it


if __name__ == "__main__":
    main()
