"""Run under `torchrun --nproc_per_node 2` (gloo, CPU): AccumTrainer on a model sharded at load time with FSDP2
(`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`) and, for comparison, the same model
under DDP, same data and target; saves per rank the full final weights, the initial ones, and the meter's count of
live parameter bytes against an independent count of the local shards."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    from transformers import DistributedConfig, LlamaForCausalLM
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.meters import live_tensor_bytes
    from tests.exactness import lm_examples, pad_collate

    src, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    result = {}
    for kind in ("ddp", "fsdp2"):
        extra = {"distributed_config": DistributedConfig(fsdp_size=2)} if kind == "fsdp2" else {}
        model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float64, **extra)
        if kind == "fsdp2":
            shards = [p.to_local() for p in model.parameters()]
            storages = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in shards}
            storages.update({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()})
            result["meter_bytes"] = live_tensor_bytes(model)
            result["local_storage_bytes"] = sum(storages.values())  # what this rank's shards keep alive
            result["local_shard_bytes"] = sum(s.numel() * s.element_size() for s in shards)
            result["sharded"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
        args = AccumTrainingArguments(
            output_dir=os.path.join(out, kind), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            target_batch_size=8, auto_tune=False, max_steps=3, learning_rate=1e-2, max_grad_norm=0.0, report_to=[],
            save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False,
            ddp_backend="gloo", logging_steps=1,
        )
        trainer = AccumTrainer(model=model, args=args, train_dataset=lm_examples(24, seed=3), data_collator=pad_collate)
        trainer.remove_callback(PrinterCallback)
        result[f"{kind}_policy"] = trainer._build_engine(pad_collate(lm_examples(2)), 2).protocol.policy.value
        trainer.train()
        full = {n: (p.full_tensor() if type(p).__name__ == "DTensor" else p).detach().clone()
                for n, p in trainer.model.named_parameters()}
        result[kind] = {n.removeprefix("module."): v for n, v in full.items()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
