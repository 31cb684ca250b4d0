"""The run: environment, overrides, the sections in order under one clock, the JSON written as each ends."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from hf_accum.probing import flops
from hf_accum.window.oom import free_memory

from .context import GPU, QUICK, ROOT, SECTION_NAMES, Clock, Ctx, Settings, _error
from .report import print_details, print_levers, print_table, write_png
from .s1_model import section_model
from .s2_probe import section_probe
from .s3_train import section_train
from .s4_oom import section_oom
from .s5_throughput import section_throughput
from .s6_tokens import section_tokens
from .s7_estimate import section_estimate
from .s8_levers import section_levers
from .s9_loss_kernels import section_loss_kernels

# --- the run ------------------------------------------------------------------------------------------------------
SECTIONS: dict[int, Callable[[Ctx], dict[str, Any]]] = {
    1: section_model, 2: section_probe, 3: section_train, 4: section_oom, 5: section_throughput, 6: section_tokens,
    7: section_estimate, 8: section_levers, 9: section_loss_kernels,
}


def environment(ctx: Ctx, argv: list[str]) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(name)
        except Exception:  # noqa: BLE001 - not installed
            return None

    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git on the machine
        commit = None
    env = {
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else f"cpu ({platform.machine()})",
        "capacity_bytes": torch.cuda.mem_get_info(ctx.device)[1] if ctx.cuda else None,
        "cuda": torch.version.cuda if ctx.cuda else None, "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(), "git_commit": commit,
        "versions": {n: version(n) for n in ("torch", "transformers", "accelerate", "peft", "bitsandbytes",
                                             "nvidia-ml-py", "matplotlib", "hf-accum")},
        "command": shlex.join(["python", "benchmarks/bench_gpu.py", *argv]),  # as run from the repo root
        "argv": argv, "quick": ctx.quick, "minutes": ctx.s.minutes,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),  # hf_accum.compat.allocator sets it on import
    }
    if ctx.cuda:
        env["bf16_peak_flops"] = flops.bf16_peak_flops(env["device"])
    return env


def with_overrides(settings: Settings, pairs: list[str]) -> Settings:
    """``FIELD=VALUE`` pairs applied to ``settings``; an int or float field takes a number, ``None`` clears it."""
    fields = dict(settings.__dict__)
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in fields or isinstance(fields[name], dict | tuple):
            scalars = sorted(k for k, v in fields.items() if not isinstance(v, dict | tuple))
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE with FIELD one of {', '.join(scalars)}")
        try:
            fields[name] = None if text == "None" else (float(text) if name == "minutes" or isinstance(fields[name], float)
                                                       else int(text))
        except ValueError:
            raise SystemExit(f"--set {pair!r}: {name} takes a number (or None)") from None
    return Settings(**fields)


def parse_sections(text: str) -> list[int]:
    try:
        chosen = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--sections={text!r}: give section numbers 1-{len(SECTIONS)} separated by commas, e.g. 2,5") from None
    bad = [n for n in chosen if n not in SECTIONS]
    if bad or not chosen:
        names = ", ".join(f"{k} {v}" for k, v in SECTION_NAMES.items())
        raise SystemExit(f"--sections={text!r}: sections are 1-{len(SECTIONS)} ({names})")
    return chosen


def main(argv: list[str] | None = None) -> int:
    import warnings

    levels = {name: logging.getLogger(name).level for name in ("transformers", "accelerate", "peft")}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", category=UserWarning)
            for name in levels:
                logging.getLogger(name).setLevel(logging.ERROR)
            return run(argv)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        gc.unfreeze()


def run(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU, a tiny Llama: every section in well under a minute")
    parser.add_argument("--sections", default=",".join(map(str, SECTIONS)), help="which sections, e.g. 2,5 (default: all)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="stop cleanly after this many minutes, writing what was measured (GPU default 8)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                        help="override one of the sizes in Settings, e.g. --set steps3=200 --set seq5=2048")
    parser.add_argument("--out", default=os.environ.get("OUT") or os.path.join("runs", "bench_gpu"),
                        help="folder for the JSON and PNG (default: $OUT where set, else runs/bench_gpu)")
    opts = parser.parse_args(argv)
    chosen = parse_sections(opts.sections)
    if not opts.quick and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run with --quick for the CPU check of every section", file=sys.stderr)
        return 2
    settings = QUICK if opts.quick else GPU
    if opts.minutes is not None:
        settings = Settings(**{**settings.__dict__, "minutes": opts.minutes})
    settings = with_overrides(settings, opts.overrides)
    os.makedirs(opts.out, exist_ok=True)
    clock = Clock(settings.minutes)
    # Imported once up front, then frozen out of the garbage collector: every free_memory() (the library calls it
    # after each probe trial) runs gc.collect, which would otherwise walk transformers' whole object graph each time.
    if any(n >= 3 for n in chosen):  # the sections that train through a Trainer
        import hf_accum.trainer  # noqa: F401
    gc.freeze()
    ctx = Ctx(settings, opts.quick, clock, opts.out)
    started = time.time()
    ctx.results = {"benchmark": "hf_accum bench_gpu", "environment": environment(ctx, argv),
                   **({"note": "quick mode: CPU and a tiny Llama; these figures check the script, they are no GPU "
                               "claim (timing goals on a shared CPU are noise)"} if ctx.quick else {}),
                   "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "sections": {}}
    print(f"bench_gpu on {ctx.results['environment']['device']} ({'quick, CPU' if ctx.quick else 'bf16'}), "
          f"sections {chosen}, limit {settings.minutes} min", flush=True)
    for number in SECTIONS:
        key = f"{number}_{SECTION_NAMES[number]}"
        if number not in chosen:
            continue
        remaining = [n for n in chosen if n >= number]
        if clock.end is not None and clock.end - time.monotonic() <= 0:
            ctx.results["sections"][key] = {"status": "skipped", "reason": "time limit (--minutes) reached before it"}
            print(f"[{number}] {SECTION_NAMES[number]}: skipped, time limit reached", flush=True)
            ctx.write()
            continue
        clock.open_section(number, remaining)
        print(f"[{number}] {SECTION_NAMES[number]} ...", flush=True)
        start = time.perf_counter()
        try:
            out = SECTIONS[number](ctx)
            status = "partial (time limit)" if out.pop("partial", False) else "ok"
            if not ctx.cuda:
                out["figures"]["null_reason"] = (
                    "CPU run (--quick): CUDA-only figures (torch.cuda.max_memory_reserved, NVML, allocator OOM counts, "
                    "MFU) are null; memory figures are the CpuMeter's tensor peaks")
            entry = {"status": status, **out}
        except Exception as exc:  # one broken section must not cost the others their figures
            entry = {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc(limit=8)}
            print(f"[{number}] error: {type(exc).__name__}: {exc}", flush=True)
            free_memory()
        entry["seconds"] = time.perf_counter() - start
        ctx.results["sections"][key] = entry
        if number == 2:  # the PNG too is on disk before the later sections, should the command be killed
            try:
                write_png(ctx)
            except Exception as exc:  # noqa: BLE001 - the final write reports it
                print(f"PNG after section 2 failed: {_error(exc)}", flush=True)
        ctx.write()
        print(f"[{number}] {SECTION_NAMES[number]}: {entry['status']} in {entry['seconds']:.1f} s", flush=True)
    clock.section_end = None
    png, why = write_png(ctx) if 2 in chosen else (None, "section 2 not selected")
    ctx.results["png"] = png
    if why:
        ctx.results["png_null_reason"] = why
        print(f"PNG: {why}")
    ctx.results["goals"] = [{"section": k, **g} for k, sec in ctx.results["sections"].items()
                            for g in sec.get("goals", [])]
    ctx.results["wall_seconds"] = time.time() - started
    ctx.results["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path = ctx.write()
    print_details(ctx)
    print_levers(ctx)
    print_table(ctx)
    print(f"\nwrote {path}" + (f" and {png}" if png else "") + f" in {ctx.results['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
