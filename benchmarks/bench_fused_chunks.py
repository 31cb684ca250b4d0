"""The fused loss's chunk size on the GPU model: one training step (AdamW) at micro-batch M x sequence S with the
model's own loss (full logits) and with the fused loss's checkpointed chunks of R rows, for several R. Prints the
peak and the step time of each next to the unfused step (bench_gpu section 6 measured the default R: 1.39x the time).

    python benchmarks/bench_fused_chunks.py --out DIR          # CUDA: bench_gpu's ~1B Llama in bf16, M 4, S 2048
    python benchmarks/bench_fused_chunks.py --quick --out DIR  # CPU, bench_gpu's tiny Llama (checks the script)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # hf_accum from this checkout, and bench_gpu's sections beside us

from gpu_bench.context import GPU, QUICK, Clock, Ctx  # noqa: E402
from gpu_bench.run import environment  # noqa: E402
from gpu_bench.s6_tokens import fused_step  # noqa: E402

import hf_accum.levers.kernels.fused_loss as fl  # noqa: E402
from hf_accum.levers.kernels import chunked  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", default="128,512,2048,8192")
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join("runs", "fused_chunks"))
    opts = parser.parse_args(argv)
    settings = QUICK if opts.quick else GPU
    ctx = Ctx(settings, opts.quick, Clock(None), opts.out)
    model = ctx.llama()
    seq, micro = settings.seq6, settings.micro6
    default_rows = fl.chunk_rows(model.config.vocab_size)
    rows = [int(r) for r in opts.rows.split(",")]
    results = {"device": environment(ctx, argv or [])["device"], "seq": seq, "micro": micro,
               "vocab": model.config.vocab_size, "default_rows": default_rows,
               "unfused": fused_step(ctx, model, seq, micro, False), "fused": {}}
    original, forced = chunked.chunk_rows, fl.IMPLEMENTATION
    try:
        fl.IMPLEMENTATION = "chunked"  # the rows are this kernel's
        for r in rows:
            chunked.chunk_rows = lambda vocab, logits=0, r=r: r
            results["fused"][r] = fused_step(ctx, model, seq, micro, True)
    finally:
        chunked.chunk_rows, fl.IMPLEMENTATION = original, forced
    base = results["unfused"]
    print(f"fused-loss chunks on {results['device']}, micro {micro} x seq {seq}, vocab {results['vocab']} "
          f"(default rows {default_rows})")
    print("| rows | peak / unfused | time / unfused | s/step |\n|---|---|---|---|")
    print(f"| unfused | 1 | 1 | {base.get('seconds_per_step', float('nan')):.3f} |")
    for r, m in results["fused"].items():
        if "peak_bytes" in m and "peak_bytes" in base:
            print(f"| {r} | {m['peak_bytes'] / base['peak_bytes']:.3f} | "
                  f"{m['seconds_per_step'] / base['seconds_per_step']:.3f} | {m['seconds_per_step']:.3f} |")
        else:
            print(f"| {r} | {m} | | |")
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "fused_chunks.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
