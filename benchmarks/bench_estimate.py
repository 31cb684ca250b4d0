"""The estimate (fake tensors: nothing allocated, nothing loaded) beside the probe's measured CPU peak, like for like.

    python benchmarks/bench_estimate.py            # Llama, GPT-2, Qwen2 x full / LoRA at seq 256 (~3 min, 2 cores)
    python benchmarks/bench_estimate.py --seq-len 512 --budget-mib 400

Each row: a size the real probe measured (CpuMeter: the profiler's allocation events), its measured peak, the
estimate's predicted peak for `--device cpu` at the same size, and the error; then both searches' largest fitting
micro-batch under the same budget, and the wall seconds of each (the estimate's includes its `peaks`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

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

    def build():
        model = AutoModelForCausalLM.from_config(config)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
        return model

    return build


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budget-mib", type=float, default=200)
    ap.add_argument("--target", type=int, default=32)
    ap.add_argument("--only", default=None, help="configurations whose name contains this")
    args = ap.parse_args(argv)
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
