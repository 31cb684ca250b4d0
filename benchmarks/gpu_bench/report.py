"""The PNG and the tables the run prints."""

from __future__ import annotations

import math
import os

from .context import PNG_NAME, Ctx, GiB, MiB, _mib
from .s8_levers import _lever_line


# --- the PNG and the table ----------------------------------------------------------------------------------------
def write_png(ctx: Ctx) -> tuple[str | None, str | None]:
    """Memory vs micro-batch per configuration, the budget and the chosen point marked; (path, None) or (None, why)."""
    if not ctx.curves:
        return None, "no memory curves measured (section 2 did not run)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return None, f"matplotlib is not importable ({exc}); no PNG"
    configs = sorted({c["config"] for c in ctx.curves}, key=lambda n: [c["config"] for c in ctx.curves].index(n))
    cols = min(4, len(configs))
    rows_n = math.ceil(len(configs) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    top = max(max((b for _, b in c["points"]), default=0) for c in ctx.curves)
    unit, scale = ("GiB", GiB) if top >= GiB else ("MiB", MiB)
    for ax, name in zip(axes.flat, configs):
        for k, curve in enumerate(c for c in ctx.curves if c["config"] == name):
            points = sorted({m: b for m, b in curve["points"]}.items())
            if not points:
                continue
            color = f"C{k}"
            ax.plot([m for m, _ in points], [b / scale for _, b in points], "o-", color=color, ms=3,
                    label=f"budget {curve['budget']}")
            ax.axhline(curve["budget_bytes"] / scale, color=color, ls="--", lw=1)
            chosen = dict(points).get(curve["chosen"])
            if chosen is not None:
                ax.plot([curve["chosen"]], [chosen / scale], "*", color=color, ms=14, mec="k")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("micro-batch")
        ax.set_ylabel(f"{unit} (reserved on CUDA)" if ctx.cuda else f"{unit} (CPU tensor peak)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(configs):]:
        ax.axis("off")
    fig.suptitle(f"hf_accum probe: memory vs micro-batch ({ctx.results['environment']['device']}); dashed: budget, "
                 "star: chosen", fontsize=10)
    fig.tight_layout()
    path = os.path.join(ctx.out, PNG_NAME)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path, None


def print_table(ctx: Ctx) -> None:
    print("\n| section | status | seconds | goal | value | target | pass |")
    print("|---|---|---|---|---|---|---|")
    for key, sec in ctx.results["sections"].items():
        head = f"| {key} | {sec['status']} | {sec.get('seconds', 0):.1f} "
        if not sec.get("goals"):
            print(head + f"| {sec.get('reason', '')} | | | |")
        for g in sec.get("goals", []):
            value = g["value"]
            value = f"{value:.3g}" if isinstance(value, float) else value
            mark = {True: "PASS", False: "FAIL", None: "-"}[g["pass"]]
            print(head + f"| {g['name']} | {value} | {g['goal']} | {mark} |")
    probe = ctx.results["sections"].get("2_probe", {}).get("figures", {}).get("rows", [])
    if probe:
        print("\n| config | seq | budget | chosen | reported max | really fits | reserved at chosen | NVML used | "
              "probe s | trials |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in probe:
            if "chosen_micro" not in r:
                print(f"| {r['config']} | {r['seq_len']} | {r['budget']} | {r.get('error', '')} | | | | | | |")
                continue
            print(f"| {r['config']} | {r['seq_len']} | {r['budget']} | {r['chosen_micro']} | {r['reported_max']} | "
                  f"{r.get('largest_really_fitting')}{' (cap)' if r.get('largest_is_cap') else ''} | "
                  f"{_mib(r.get('chosen_reserved_bytes'))} | {_mib(r.get('chosen_nvml_used_bytes'))} | "
                  f"{r['probe_seconds']:.1f} | {r['probe_trials']} |")


def print_details(ctx: Ctx) -> None:
    """Sections 3, 5 and 6 in a few lines each (the JSON has everything)."""
    sections = ctx.results["sections"]
    train = sections.get("3_train", {}).get("figures", {}).get("rows", [])
    if train:
        print("\n| plan trained (section 3) | seq | budget | plan | steps | OOMs | peak / budget |")
        print("|---|---|---|---|---|---|---|")
        for r in train:
            if "steps" not in r:
                print(f"| {r['config']} | {r['seq_len']} | {r['budget']} | {r.get('error', '')} | | | |")
                continue
            ratio = r.get("peak_over_budget")
            print(f"| {r['config']} | {r['seq_len']} | {r['budget']} | {r['plan'].get('describe')} | {r['steps']} | "
                  f"{r['oom_warnings'] + (r['allocator_ooms'] or 0)} | {'-' if ratio is None else f'{ratio:.3f}'} |")
    tp = sections.get("5_throughput", {}).get("figures", {})
    if tp.get("tokens_per_second_by_micro") is not None:
        by = ", ".join(f"micro {m}: {v:.0f}" for m, v in sorted(tp["tokens_per_second_by_micro"].items()))
        mfu = tp.get("mfu_plan")
        print(f"\nthroughput (section 5, seq {tp['seq_len']}, target {tp['target']}): plan "
              f"{tp['plan'].get('describe')} {tp.get('plan_tokens_per_second') or 0:.0f} tokens/s; {by}; MFU at the "
              f"plan {'-' if mfu is None else f'{mfu:.3f}'}; AccumTrainer / Trainer "
              f"{', '.join(f'{r:.3f}' for r in tp.get('overhead', {}).get('ratios', []))} (rounds)")
    tok = sections.get("6_tokens", {}).get("figures", {})
    for mode, m in tok.get("modes", {}).items():
        print(f"tokens vs samples (section 6): {mode}: {m['forwards_per_step']:.2f} forwards/step, padded/real "
              f"{m['padded_over_real_tokens']:.2f}, {m['seconds_per_step'] or 0:.3f} s/step, peak/budget "
              f"{m['peak_over_budget'] or 0:.3f}")
    fused = tok.get("fused_loss", {})
    if "peak_ratio" in fused:
        print(f"fused loss on/off (section 6, micro {fused['micro']} x {fused['seq_len']}, vocab {fused['vocab']}): "
              f"peak {fused['peak_ratio']:.3f}x, time {fused['time_ratio']:.3f}x ({fused['implementation']})")


def print_levers(ctx: Ctx) -> None:
    """Section 8 as one table: a row per level, a column per micro-batch (s/step and peak; reserved on CUDA)."""
    fig = ctx.results["sections"].get("8_levers", {}).get("figures", {})
    if not fig.get("rows"):
        return
    micros = fig["micros"]
    cells = {(r["level"], r["layers"], r["micro"]): r for r in fig["rows"]}
    print(f"\n| level (section 8, seq {fig['seq_len']}) | " + " | ".join(f"micro {m}" for m in micros) + " |")
    print("|---|" + "---|" * len(micros))
    for kind, k in dict.fromkeys((r["level"], r["layers"]) for r in fig["rows"]):
        out = []
        for m in micros:
            r = cells.get((kind, k, m))
            if r is None or r["result"] != "ok":
                out.append("-" if r is None else r["result"])
            else:
                peak = r["peak_reserved_bytes"] if r["peak_reserved_bytes"] is not None else r["peak_allocated_bytes"]
                out.append(f"{r['step_seconds']:.3f} s, {_mib(peak)}")
        print(f"| {kind} {k} | " + " | ".join(out) + " |")
    for kind, why in fig.get("skipped", {}).items():
        print(f"{kind}: {why}")
    tuner = fig.get("tuner", {})
    if "plan" in tuner:
        m = tuner.get("measured", {})
        print(f"tuner (budget {_mib(tuner['budget_bytes'])}, target {tuner['target']}): {tuner['plan'].get('describe')}"
              f" in {tuner['probe_seconds']:.1f} s; measured {_lever_line(m) if m else '-'}")
    elif tuner:
        print(f"tuner: skipped ({tuner.get('skipped')})")


