"""Run under `torchrun --nproc_per_node 2` (gloo, CPU): a small Llama from config under real FSDP2 (`fully_shard` on
every decoder layer, then the root, as accelerate and the Trainer apply it), full fine-tuning and LoRA; each rank
runs the probe's own step (`probe.make_step_fn`: forward, backward, AdamW, gradients zeroed not freed) at every
micro-batch of SIZES after one warm-up step, measured by the probe's CPU meter with every live tensor as its
baseline (as `probing.engine` measures a sharded engine), and writes OUT/CASE.rankR.json: micro-batch -> peak bytes.

argv: OUT SEQ_LEN SIZES(comma list) CASES(comma list of full, lora, full-keep: full without resharding after forward)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def small_llama_config():
    """The small Llama both sides build (the test's estimate from this config, the ranks their model)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False)


def build(case):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(small_llama_config())
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                                 task_type="CAUSAL_LM"))
    return model


def sharded(model, reshard):
    from torch.distributed.fsdp import fully_shard

    from hf_accum.compat.gradient_checkpointing import checkpointable_layers

    for layer in checkpointable_layers(model):
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def main():
    out, seq_len, sizes, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import torch.distributed as dist

    from hf_accum.probing.meters import CpuMeter, all_live_tensor_bytes
    from hf_accum.probing.probe import make_step_fn, random_token_batch

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for case in cases.split(","):
        model = sharded(build(case.removesuffix("-keep")), reshard=not case.endswith("-keep"))
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-3)
        torch.manual_seed(rank)
        step = make_step_fn(model, opt, random_token_batch(model, seq_len))
        step(1)  # the warm-up: gradients and AdamW's state created, as the probe's
        meter = CpuMeter(resident=all_live_tensor_bytes)
        peaks = {int(m): meter.measure(lambda m=int(m), step=step: step(m)).peak_bytes for m in sizes.split(",")}
        with open(os.path.join(out, f"{case}.rank{rank}.json"), "w") as f:
            json.dump(peaks, f)
        del model, opt, step
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
