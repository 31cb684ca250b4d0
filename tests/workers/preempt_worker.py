"""Trains float64 GPT-2 for 12 optimizer steps and saves the final weights. Modes:
- `self N`: the run sends itself a real SIGTERM during step N (one process).
- `marker N`: after step N it writes `marker` in the output folder and slows down, so that the test can send a
  signal from outside (to this process, or to torchrun, which forwards it to every rank).
- `resume`: resume_from_checkpoint=True and finish.
- `plain`: an uninterrupted run.
A last argument `print` keeps transformers' PrinterCallback: every step prints its logs to stdout. Several runs,
separated by `+` (`A resume + B plain`), run in turn in one launch. Runs under plain `python` or
`torchrun --nproc_per_node 2` (gloo), or in the test's own process (`run`)."""

import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from tests.exactness import lm_examples, pad_collate, sum_over_items_loss, tiny_gpt2  # noqa: E402


class Signals(TrainerCallback):
    def __init__(self, mode, step, out):
        self.mode, self.step, self.out = mode, step, out

    def on_step_begin(self, args, state, control, **kwargs):
        if self.mode == "self" and state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step N runs

    def on_step_end(self, args, state, control, **kwargs):
        if self.mode == "marker" and state.global_step >= self.step:
            if state.global_step == self.step and args.process_index == 0:
                open(os.path.join(self.out, "marker"), "w").close()
            time.sleep(0.5)


def main():
    argv = sys.argv[1:]
    while argv:  # OUT MODE [N] [print], then "+" and the next run
        this, argv = (argv[:argv.index("+")], argv[argv.index("+") + 1:]) if "+" in argv else (argv, [])
        out, mode, *rest = this
        run(out, mode, int(rest[0]) if rest and rest[0] != "print" else 0, printing=rest[-1:] == ["print"])
    if torch.distributed.is_initialized():  # left to interpreter exit, gloo's threads can abort it (SIGABRT)
        torch.distributed.destroy_process_group()


def run(out, mode, step=0, printing=False):
    from hf_accum import AccumTrainer, AccumTrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = AccumTrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, target_batch_size=4 * world,
        auto_tune=False, max_steps=12, learning_rate=1e-2, max_grad_norm=0.0, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False, logging_steps=1,
        **({"ddp_backend": "gloo"} if world > 1 else {}),
    )
    trainer = AccumTrainer(model=tiny_gpt2(), args=args, train_dataset=lm_examples(96, seed=6),
                           data_collator=pad_collate, compute_loss_func=sum_over_items_loss,
                           callbacks=[Signals(mode, step, out)])
    if not printing:
        trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    rank = trainer.args.process_index
    torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()},
               os.path.join(out, f"final.rank{rank}.pt"))


if __name__ == "__main__":
    main()
