"""Run under `torchrun --nproc_per_node 2`: asking for FSDP on CPU (accelerate would silently run DDP) and
use_cpu=False without GPUs (each rank would see world 1) must both be refused; writes each message per rank."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    refusals(sys.argv[1], int(os.environ["RANK"]))


def refusals(out, rank):
    """Writes OUT/rank{RANK}.json: what each request raised (None where nothing was raised). Also run first in
    `fsdp2_worker.py`'s launches, before anything else initializes the process."""
    from hf_accum import AccumTrainer, AccumTrainingArguments
    from tests.exactness import tiny_llama

    os.makedirs(out, exist_ok=True)
    messages = {}
    for name, kw in {"fsdp_on_cpu": {"use_cpu": True, "fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2},
                                     "ddp_backend": "gloo"},
                     "world_one": {"use_cpu": False}}.items():
        try:
            args = AccumTrainingArguments(output_dir=os.path.join(out, name), report_to=[], **kw)
            AccumTrainer(model=tiny_llama(), args=args)
            messages[name] = None
        except ValueError as exc:
            messages[name] = str(exc)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(messages, f)


if __name__ == "__main__":
    main()
