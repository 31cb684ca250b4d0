"""The estimate (fake tensors: nothing allocated, nothing loaded) beside the probe's measured CPU peak, like for like.

    python benchmarks/bench_estimate.py            # Llama, GPT-2, Qwen2 x full / LoRA at seq 256 (~3 min, 2 cores)
    python benchmarks/bench_estimate.py --seq-len 512 --budget-mib 400
    python benchmarks/bench_estimate.py --compare-8b  # Llama-3-8B's config, LoRA r16, bf16, seq 2048, cuda, 80 GiB,
                                                      # beside accelerate estimate-memory's and Unsloth's figures

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

from hf_accum.probing.estimate_check import against_probe  # noqa: E402

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

    from hf_accum.probing.paper import with_lora

    build = lambda: AutoModelForCausalLM.from_config(config)  # noqa: E731
    return with_lora(build, 8, None) if lora else build


UNSLOTH_URL = "https://unsloth.ai/docs/get-started/fine-tuning-for-beginners/unsloth-requirements"
#: Unsloth's "absolute minimum" VRAM for an 8B model (its requirements page, table by model parameters): QLoRA
#: (4-bit) and LoRA (16-bit); no batch size or sequence length is given.
UNSLOTH_8B = {"QLoRA (4-bit)": "6 GB", "LoRA (16-bit)": "22 GB"}


def llama3_8b_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, tie_word_embeddings=False, dtype="bfloat16")


def accelerate_rows(config) -> list[tuple[str, float, float, float | None]]:
    """What `accelerate estimate-memory` prints for the model, computed offline as it does (accelerate's own
    `calculate_maximum_sizes` on the model built from its config on the meta device, then `estimate_training_usage`
    per dtype; float32 weights, as its empty model): (dtype, largest layer, total size, training using Adam) in bytes,
    None where it prints N/A. Adds the bfloat16 row its function knows (the CLI offers float32/float16/int8/int4)."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        total, largest = calculate_maximum_sizes(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    rows = []
    for dtype, divide in (("float32", 1), ("float16", 2), ("bfloat16", 2), ("int8", 4), ("int4", 8)):
        adam = max(estimate_training_usage(total, dtype).values())
        rows.append((dtype, largest[0] / divide, total / divide, None if adam == -1 else adam))
    return rows


def compare_8b() -> None:
    """Our estimate for Llama-3-8B's config (LoRA r16 on every linear layer, bf16, seq 2048, cuda, 80 GiB) beside
    accelerate's `estimate-memory` figures and Unsloth's VRAM table for the same model size."""
    from transformers import AutoModelForCausalLM

    from hf_accum import estimate
    from hf_accum.probing.paper import with_lora

    config = llama3_8b_config()
    build = with_lora(lambda: AutoModelForCausalLM.from_config(config), 16, None)
    wall, cpu = time.perf_counter(), time.process_time()
    est = estimate(build, seq_len=2048, target_batch_size=32, device="cuda", device_memory="80GiB", bf16=True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print("hf_accum estimate: Llama-3-8B config (hidden 4096, 32 layers, vocab 128256, intermediate 14336, 8 KV "
          "heads), LoRA r16 all-linear, bf16 weights + autocast, seq 2048, --device cuda --device-memory 80GiB "
          "(budget 0.9)")
    print("| micro-batch | " + " | ".join(str(m) for m in est.peaks) + " |")
    print("|---|" + "---:|" * len(est.peaks))
    print("| predicted peak (GiB) | " + " | ".join(f"{p / 2**30:.2f}" for p in est.peaks.values()) + " |")
    print(f"largest fit {est.result.max_micro_batch_size}; plan: {est.plan.describe()}")
    print(f"estimate took {wall:.0f} s wall, {cpu:.0f} s CPU (os.cpu_count()={os.cpu_count()}, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})")
    print()
    print("accelerate estimate-memory (computed offline: accelerate's own functions on the meta-device model; any batch,"
          " any sequence length, no activations, no LoRA)")
    print("| dtype | largest layer (GiB) | total size (GiB) | training using Adam (GiB) |")
    print("|---|---:|---:|---:|")
    for dtype, layer, total, adam in accelerate_rows(config):
        print(f"| {dtype} | {layer / 2**30:.2f} | {total / 2**30:.2f} | "
              f"{'N/A' if adam is None else f'{adam / 2**30:.2f}'} |")
    print()
    print(f"Unsloth's VRAM table, 8B ('absolute minimum', no batch or sequence length given; {UNSLOTH_URL}): "
          + ", ".join(f"{k} {v}" for k, v in UNSLOTH_8B.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budget-mib", type=float, default=200)
    ap.add_argument("--target", type=int, default=32)
    ap.add_argument("--only", default=None, help="configurations whose name contains this")
    ap.add_argument("--compare-8b", "--llama3-8b", action="store_true", dest="compare_8b",
                    help="only the Llama-3-8B estimate beside accelerate's and Unsloth's figures (a few minutes)")
    args = ap.parse_args(argv)
    if args.compare_8b:
        compare_8b()
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
