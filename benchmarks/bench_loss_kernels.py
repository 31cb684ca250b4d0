"""The LM-head loss kernels side by side (hf_accum/levers/kernels/): every kernel that runs on the device x chunk sizes,
one loss forward + backward from the hidden states (rows = micro x seq) through the head's weight, peak memory and
time relative to the unfused loss (F.linear -> float -> cross_entropy on the full logits), and the tuner's pick
(`kernels.choose` over each kernel at its default chunk, the probe's rule) against the sweep's fastest.

    python benchmarks/bench_loss_kernels.py                 # CPU: micro 2 x seq 512, hidden 256, vocab 32000, float32
    python benchmarks/bench_loss_kernels.py --device cuda   # micro 4 x seq 2048, hidden 2048, vocab 128256, bf16
                                                            # (bench_gpu.py's section "loss kernels" runs this)
Kernels that do not run here are listed with the reason (Liger and Cut Cross-Entropy need CUDA and their package).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hf_accum.levers import kernels  # noqa: E402

SHAPES = {"cpu": dict(micro=2, seq=512, hidden=256, vocab=32000, dtype="float32", rows=(128, 512, 2048)),
          "cuda": dict(micro=4, seq=2048, hidden=2048, vocab=128256, dtype="bfloat16", rows=(256, 1024, 4096))}


def _unfused(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y, reduction="sum")


def measure(fn, h, w, y, device: str, repeats: int) -> dict:
    """Peak bytes above the inputs (CUDA: the allocator's; CPU: the profiler's) and the best of ``repeats`` timings
    of one forward + backward."""
    def once():
        h.grad = w.grad = None
        fn(h, w, y).backward()

    once()  # warm
    peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        once()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        from hf_accum.probing.meters import CpuMeter

        peak = CpuMeter(resident=lambda: 0).measure(once).peak_bytes
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        once()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return {"peak_bytes": peak, "seconds": best}


def run(device: str = "cpu", repeats: int = 3, shape: dict | None = None) -> dict:
    s = {**SHAPES[device], **(shape or {})}
    dtype = getattr(torch, s["dtype"])
    g = torch.Generator(device=device).manual_seed(0)
    n = s["micro"] * s["seq"]
    h = (torch.randn(n, s["hidden"], device=device, generator=g, dtype=dtype) * 0.5).requires_grad_()
    w = (torch.randn(s["vocab"], s["hidden"], device=device, generator=g, dtype=dtype) * 0.02).requires_grad_()
    y = torch.randint(0, s["vocab"], (n,), device=device, generator=g)
    out = {"device": device, "shape": s, "unfused": measure(_unfused, h, w, y, device, repeats), "kernels": {},
           "unavailable": {}}
    for k in kernels.registered():
        why = k.unavailable(device, dtype, False)
        if why is not None:
            out["unavailable"][k.NAME] = why
            continue
        chunked = k.NAME in ("torch", "chunked")  # the kernels with a chunk size (ours decides both)
        default = kernels.get("chunked").rows_for(device, s["vocab"]) if chunked else None
        for rows in [default] + [r for r in s["rows"] if chunked and r != default]:
            kw = {} if rows is None else {"rows": rows}
            fn = lambda h, w, y, k=k, kw=kw: k.loss_sum(h, w, None, y, **kw)  # noqa: E731
            out["kernels"][k.NAME + ("" if rows is None else f"@{rows}")] = measure(fn, h, w, y, device, repeats)
            out.setdefault("defaults", {})[k.NAME] = k.NAME + ("" if default is None else f"@{default}")
    measured = {name: (out["kernels"][key]["seconds"], out["kernels"][key]["peak_bytes"])
                for name, key in out["defaults"].items()}
    pick = out["defaults"][kernels.choose(measured, 1 << 62, next(iter(measured)))]
    fastest = min(out["kernels"], key=lambda name: out["kernels"][name]["seconds"])
    out.update(pick=pick, fastest=fastest,
               pick_vs_fastest=out["kernels"][pick]["seconds"] / out["kernels"][fastest]["seconds"])
    return out


def table(out: dict) -> str:
    base = out["unfused"]
    s = out["shape"]
    lines = [f"loss kernels on {out['device']}: rows {s['micro']} x {s['seq']}, hidden {s['hidden']}, vocab {s['vocab']}, "
             f"{s['dtype']}; one loss forward + backward, relative to the unfused loss "
             f"({base['peak_bytes'] / 2**20:.0f} MiB, {base['seconds'] * 1e3:.1f} ms)",
             "| kernel[@rows per chunk] | peak / unfused | time / unfused | ms |", "|---|---|---|---|"]
    for name, m in out["kernels"].items():
        lines.append(f"| {name} | {m['peak_bytes'] / base['peak_bytes']:.3f} | {m['seconds'] / base['seconds']:.3f} | "
                     f"{m['seconds'] * 1e3:.1f} |")
    for name, why in out["unavailable"].items():
        lines.append(f"| {name} | not here: {why} | | |")
    lines.append(f"tuner's pick (the fastest kernel at its default chunk, as the probe chooses): {out['pick']}, {out['pick_vs_fastest']:.3f}x the "
                 f"sweep's fastest ({out['fastest']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    opts = p.parse_args(argv)
    out = run(opts.device, opts.repeats)
    print(table(out))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
