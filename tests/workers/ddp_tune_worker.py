"""Run under `torchrun --nproc_per_node 2`: each rank probes with its own memory budget (rank 1 tighter, as a
GPU shared with another process would be); both must adopt the same, most constrained plan and train. Arguments:
one or more output folders, each run in turn; a folder followed by "auto" also has the probe choose the
checkpointing level (checkpoint_layers="auto"), else checkpointing is off."""

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def runs(argv):
    """[(folder, auto)] from `FOLDER [auto] [FOLDER [auto]] ...`."""
    out = []
    for arg in argv:
        if arg == "auto":
            out[-1] = (out[-1][0], True)
        else:
            out.append((arg, False))
    return out


def main():
    for out, auto in runs(sys.argv[1:]):
        train(out, auto)
        gc.collect()  # the next run's probe starts from this process's memory without the last trainer


def train(out, auto):
    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.tiny import SFTCollator, build_model, build_sft_dataset, build_tokenizer

    rank = int(os.environ["RANK"])
    tok = build_tokenizer()
    budget = [12, 7][rank] * 2**20
    args = AccumTrainingArguments(
        output_dir=os.path.join(out, f"rank{rank}"), target_batch_size=16, memory_budget_bytes=budget,
        use_cpu=True, ddp_backend="gloo", report_to=[], max_steps=2, save_strategy="no", disable_tqdm=True,
        **({"probe_seq_len": 128} if auto else {"gradient_checkpointing": False}),
    )
    trainer = AccumTrainer(model=build_model(tokenizer=tok), args=args, train_dataset=build_sft_dataset(64, tok),
                           data_collator=SFTCollator(tok))
    trainer.train()
    result = trainer.probe_result
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"plan": trainer.plan.to_dict(), "steps": trainer.state.global_step,
                   "local_max": result.extra.get("local_max_micro_batch_size", result.max_micro_batch_size),
                   "agreed_max": result.max_micro_batch_size,
                   "levels": result.extra.get("checkpointing", {}).get("levels"),
                   "local_level0_max": next((t.micro_batch_size for t in reversed(result.trials)
                                             if t.fits and t.checkpointed_layers == 0), None),
                   "checkpointed_now": _checkpointed(trainer.model)}, f)


def _checkpointed(model):
    from hf_accum.compat import gradient_checkpointing

    return gradient_checkpointing.checkpointed_count(model)


if __name__ == "__main__":
    main()
