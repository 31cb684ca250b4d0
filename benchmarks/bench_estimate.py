"""The estimate (fake tensors: nothing allocated, nothing loaded) beside the probe's measured CPU peak, like for like.

    python benchmarks/bench_estimate.py            # Llama, GPT-2, Qwen2 x full / LoRA at seq 256 (~3 min, 2 cores)
    python benchmarks/bench_estimate.py --seq-len 512 --budget-mib 400
    python benchmarks/bench_estimate.py --llama3-8b  # Llama-3-8B's config, LoRA r16, bf16, seq 2048, cuda, 80 GiB

Each row: a size the real probe measured (CpuMeter: the profiler's allocation events), its measured peak, the
estimate's predicted peak for `--device cpu` at the same size, and the error; then both searches' largest fitting
micro-batch under the same budget, and the wall seconds of each (the estimate's includes its `peaks`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_accum.estimating.check import against_probe  # noqa: E402

MiB = 2**20


def configs(hidden: int, layers: int):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    return {
        "llama": LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=4096),
        "gpt2": GPT2Config(vocab_size=4096, n_embd=hidden, n_layer=layers, n_head=4, n_positions=4096),
        "qwen2": Qwen2Config(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=4096),
    }


def builder(config, lora: bool):
    from transformers import AutoModelForCausalLM

    from hf_accum.estimating.command import with_lora

    build = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    return with_lora(build, 8, None) if lora else build


def llama3_8b() -> None:
    """Our estimate for Llama-3-8B's config beside accelerate's `estimate-memory` figure for the same model (its
    "Training using Adam" for bfloat16: weights, gradients and Adam states, no activations, no LoRA)."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_accum.estimating import estimate
    from hf_accum.estimating.command import with_lora

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=False, dtype="bfloat16")
    build = with_lora(lambda: AutoModelForCausalLM.from_config(config), 16, None)
    wall, cpu = time.perf_counter(), time.process_time()
    est = estimate(build, seq_len=2048, target_batch_size=32, device="cuda", device_memory="80GiB", bf16=True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print("Llama-3-8B config, LoRA r16 all-linear, bf16 weights + autocast, seq 2048, --device cuda, 80 GiB "
          "(budget 0.9)")
    for micro, peak in est.peaks.items():
        print(f"  micro {micro}: predicted peak {peak / 2**30:.2f} GiB")
    print(f"  largest fit {est.result.max_micro_batch_size}; plan: {est.plan.describe()}")
    print(f"  estimate took {wall:.0f} s wall, {cpu:.0f} s CPU")
    with torch.device("meta"):
        total, _largest = calculate_maximum_sizes(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    adam = max(estimate_training_usage(total, "bfloat16").values())
    print(f"  accelerate estimate-memory, 'Training using Adam' (bfloat16 row): {adam / 2**30:.2f} GiB, any batch")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budget-mib", type=float, default=200)
    ap.add_argument("--target", type=int, default=32)
    ap.add_argument("--only", default=None, help="configurations whose name contains this")
    ap.add_argument("--llama3-8b", action="store_true", help="only the Llama-3-8B estimate (a few minutes)")
    args = ap.parse_args(argv)
    if args.llama3_8b:
        llama3_8b()
        return 0
    print(f"seq {args.seq_len}, hidden {args.hidden}, {args.layers} layers, vocab 4096, budget {args.budget_mib:g} "
          f"MiB, target {args.target}, AdamW, float32, CPU")
    print(f"{'config':<12} {'micro':>5} {'measured MiB':>13} {'estimate MiB':>13} {'error':>7}")
    worst = 0.0
    for arch, config in configs(args.hidden, args.layers).items():
        for lora in (False, True):
            name = f"{arch}-{'lora' if lora else 'full'}"
            if args.only and args.only not in name:
                continue
            began = time.perf_counter()
            rows, real_max, est_max, est = against_probe(builder(config, lora), seq_len=args.seq_len,
                                                         target_batch_size=args.target,
                                                         budget_bytes=int(args.budget_mib * MiB))
            seconds = time.perf_counter() - began
            for row in rows:
                worst = max(worst, abs(row.error))
                print(f"{name:<12} {row.micro:>5} {row.measured / MiB:>13.2f} {row.estimated / MiB:>13.2f} "
                      f"{row.error:>+7.2%}")
            print(f"{name:<12} largest fit: probe {real_max}, estimate {est_max}"
                  f"{'' if real_max == est_max else '  <-- differs'}  ({seconds:.1f} s for both)")
    print(f"worst error: {worst:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
