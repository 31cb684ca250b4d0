"""Run under `torchrun --nproc_per_node 2`: `ddp_oom_worker.py OUT MODE [MODE ...]`, the modes run in turn in one
launch, each in its own folder OUT/MODE (a mode that stops the ranks comes last, alone). Modes:
- forward:CALL: rank 1's forward number CALL raises an OOM (3: mid-window, 4: the window's final forward); then a
  clean run with the smaller micro-batch from the start (trained once per launch, the same for every CALL).
  Saves both runs' final weights and plans per rank, and what the hf_accum loggers said during the mode.
- backward: rank 1 raises an OOM inside the window's final, gradient-synchronizing backward (must stop cleanly).
- growback: rank 1's first forward raises an OOM; with grow_back_steps=1 both ranks return to micro 4 x 2 after
  step 2; then a clean run.
- stop: the trainer declares collectives in compute_loss (as TRL's do); rank 1's forward 3 raises an OOM: every
  rank must stop with the plan to restart with (skipping a forward would hang the other rank).
"""

import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2  # noqa: E402
from tests.trainer.test_oom_recovery import OOMAt  # noqa: E402


class OOMInBackward:
    def __init__(self, module, call):
        self.call, self.count = call, 0
        module.register_full_backward_hook(self)

    def __call__(self, module, grad_input, grad_output):
        self.count += 1
        if self.count == self.call:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the synchronized backward)")


def train(out, micro, accum, inject=None, collectives_in_compute_loss=False, **kw):
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments

    model = tiny_gpt2()
    args = AccumTrainingArguments(
        output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
        target_batch_size=micro * accum * 2, auto_tune=False, num_train_epochs=1, learning_rate=1e-2,
        max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        remove_unused_columns=False, ddp_backend="gloo", logging_steps=1, **kw,
    )
    cls = type("Gathering", (AccumTrainer,), {"collectives_in_compute_loss": collectives_in_compute_loss})
    trainer = cls(model=model, args=args, train_dataset=lm_examples(48, seed=4), data_collator=pad_collate,
                           compute_loss_func=sum_over_items_loss)
    trainer.remove_callback(PrinterCallback)
    if inject is not None:
        inject(model)
    trainer.train()
    return trainer


class Said(logging.Handler):
    """The messages the hf_accum loggers emit at WARNING and above, while they are still printed as before (Python's
    last-resort stderr handler is attached beside it, so the launch's output is unchanged)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main():
    out, modes = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    said = Said()
    for handler in (said, logging.lastResort):
        logging.getLogger("hf_accum").addHandler(handler)
    clean = None
    for spec in modes:
        mode, *call = spec.split(":")
        folder = os.path.join(out, spec.replace(":", ""))
        os.makedirs(folder, exist_ok=True)
        said.lines = []
        if mode == "forward":
            hit = train(os.path.join(folder, "hit"), 4, 2,
                        (lambda m, c=int(call[0]): OOMAt(m, [c])) if rank == 1 else None)
            lines = list(said.lines)  # this mode's hit run
            clean = clean or train(os.path.join(out, "clean"), 2, 4)  # the same clean run for every CALL
            save(folder, rank, hit, clean, {"plan": hit.plan.to_dict(), "said": lines,
                                            "steps": [hit.state.global_step, clean.state.global_step]})
        elif mode == "growback":  # rank 1's first forward runs out of memory; both grow back after 1 clean step
            hit = train(os.path.join(folder, "hit"), 4, 2, (lambda m: OOMAt(m, [1])) if rank == 1 else None,
                        grow_back_steps=1)
            lines = list(said.lines)  # this mode's hit run
            save(folder, rank, hit, train(os.path.join(folder, "clean"), 4, 2),
                 {"plan": hit.plan.to_dict(), "cut": hit._engine.cut_units, "said": lines})
        elif mode == "stop":
            train(os.path.join(folder, "hit"), 4, 2, (lambda m: OOMAt(m, [3])) if rank == 1 else None,
                  collectives_in_compute_loss=True)
        elif mode == "backward":
            train(os.path.join(folder, "hit"), 4, 2,
                  (lambda m: OOMInBackward(m.lm_head, 2)) if rank == 1 else None)
        else:
            raise SystemExit(f"unknown mode {spec!r}")


def save(folder, rank, hit, clean, record):
    torch.save({"hit": hit.model.state_dict(), "clean": clean.model.state_dict()},
               os.path.join(folder, f"weights.rank{rank}.pt"))
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
