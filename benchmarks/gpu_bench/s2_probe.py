"""Section 2, probe: the probe's chosen micro-batch beside an exhaustive sweep of real steps around it."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from hf_accum.probing.plan import divisors
from hf_accum.probing.probe import make_step_fn, probe_model, random_token_batch, resolve_budget
from hf_accum.window.oom import free_memory, is_oom

from .context import Ctx, _error, plan_facts, release, set_checkpointing, typical
from .data import budget_label, goal, peak_at_one


# --- section 2: probe vs exhaustive sweep ---------------------------------------------------------------------------
class Sweep:
    """Real steps at chosen sizes through the meter, each size at most once; a size fits when it ran and its
    charged memory (reserved on CUDA) is within the budget."""

    def __init__(self, ctx: Ctx, model, seq: int, budget: int, end: float | None) -> None:
        self.ctx, self.budget, self.end = ctx, budget, end
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=1e-5)
        self.step = make_step_fn(model, self.opt, random_token_batch(model, seq))
        self.meter = ctx.meter(model, self.opt)
        self.rows: dict[int, dict[str, Any]] = {}
        self.cut_short = False
        self.step(1)  # the optimizer's state, as the probe's warm-up makes it

    def fits(self, micro: int) -> bool | None:
        """None: not measured (time ran out, or on CPU predicted past what this process can get)."""
        if micro in self.rows:
            return self.rows[micro]["fits"]
        if self.end is not None and time.monotonic() > self.end:
            self.cut_short = True
            return None
        m = None
        try:
            m = self.meter.measure(lambda: self.step(micro))
        except Exception as exc:
            if not is_oom(exc):
                raise
        if m is None:
            free_memory()
            self.rows[micro] = {"micro": micro, "fits": False, "status": "out of memory"}
            return False
        used, why = self.ctx.nvml_used()
        self.rows[micro] = {
            "micro": micro, "fits": m.charged_bytes <= self.budget, "peak_allocated_bytes": m.peak_bytes,
            "max_memory_reserved_bytes": m.reserved_bytes, "charged_bytes": m.charged_bytes, "seconds": m.seconds,
            "nvml_used_bytes": used, **({"nvml_null_reason": why} if why else {}),
            "status": "fits" if m.charged_bytes <= self.budget else "over budget",
        }
        return self.rows[micro]["fits"]

    def largest(self, start: int, cap: int) -> tuple[int | None, bool]:
        """The largest size that fits (gallop up from ``start``, then bisect), and whether it is the cap."""
        # what is already measured bounds the search: the largest fitting size and the smallest failing one
        lo = max((m for m, r in self.rows.items() if r["fits"]), default=0)
        hi = min((m for m, r in self.rows.items() if not r["fits"] and m > lo), default=cap + 1)
        if hi <= 1:
            return 0, False
        probe = max(1, min(start, cap))
        if probe <= lo or probe >= hi:
            probe = lo if lo else min(probe, hi - 1)
        ok = self.fits(probe)
        if ok is None:
            return None, False
        if ok:
            lo, step = probe, 1
            while lo + step < hi:
                ok = self.fits(lo + step)
                if ok is None:
                    return None, False
                if not ok:
                    hi = lo + step
                    break
                lo, step = lo + step, step * 2
            else:
                if hi == cap + 1 and lo < cap:  # nothing above is known not to fit: try the cap itself
                    ok = self.fits(cap)
                    if ok is None:
                        return None, False
                    lo, hi = (cap, cap + 1) if ok else (lo, cap)
        else:
            hi = probe
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok = self.fits(mid)
            if ok is None:
                return None, False
            lo, hi = (mid, hi) if ok else (lo, mid)
        return lo, lo == cap

    def close(self, model) -> None:
        self.opt.state.clear()
        model.zero_grad(set_to_none=True)
        free_memory()


def probe_and_sweep(ctx: Ctx, model, name: str, seq: int, budget: tuple[str, float], end: float | None) -> dict:
    from hf_accum.levers.kernels.fused_loss import fused_lm_loss, resolve_for_model

    target = ctx.s.target
    fused, fused_why = resolve_for_model(model, None)
    row: dict[str, Any] = {"config": name, "seq_len": seq, "budget": budget_label(budget), "target": target,
                           "fused_loss": fused, "fused_loss_reason": fused_why}
    with fused_lm_loss(model) if fused else contextlib.nullcontext():
        if budget[0] == "fraction":
            budget_bytes = resolve_budget(ctx.meter(model), None, budget[1])
        else:
            budget_bytes = int(budget[1] * peak_at_one(ctx, model, seq))
        row["budget_bytes"] = budget_bytes
        ctx.reset_peak()
        start = time.perf_counter()
        try:
            result, plan = probe_model(model, seq_len=seq, target_batch_size=target, budget_bytes=budget_bytes,
                                       optimizer_cls=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-5})
        except ValueError as exc:  # NothingFitsError: micro 1 does not fit this budget
            row.update(probe_seconds=time.perf_counter() - start, error=str(exc).splitlines()[0])
            return row
        facts = plan_facts(plan)
        chosen = int(facts["rows_per_forward_effective"])
        row.update(probe_seconds=time.perf_counter() - start, probe_trials=len(result.measured_trials),
                   plan=facts, chosen_micro=chosen, reported_max=result.max_micro_batch_size,
                   probe_trial_sizes=[t.micro_batch_size for t in result.trials],
                   probe_points=[(t.micro_batch_size, t.reserved_bytes or t.peak_bytes, t.fits)
                                 for t in result.trials if t.peak_bytes is not None])
        if ctx.s.seeded2:
            row.update(seeded_probe(model, seq, target, budget_bytes))
        # the sweep: the choice, then the largest that really fits, then the divisors around the choice and micro 1
        sweep_start = time.perf_counter()
        sweep = Sweep(ctx, model, seq, budget_bytes, end)
        try:
            sweep.fits(chosen)
            true_max, capped = sweep.largest(max(chosen, result.max_micro_batch_size), target)
            near = [d for d in divisors(target) if chosen // 4 <= d <= 2 * max(chosen, 1)]
            for micro in sorted({1, *near}):
                sweep.fits(micro)
        finally:
            sweep.close(model)
    at_chosen = sweep.rows.get(chosen, {})
    row.update(
        largest_really_fitting=true_max, largest_is_cap=capped, sweep_cut_short=sweep.cut_short,
        sweep_seconds=time.perf_counter() - sweep_start, sweep_steps=len(sweep.rows),
        sweep=[sweep.rows[m] for m in sorted(sweep.rows)],
        chosen_reserved_bytes=at_chosen.get("max_memory_reserved_bytes"),
        chosen_charged_bytes=at_chosen.get("charged_bytes"), chosen_nvml_used_bytes=at_chosen.get("nvml_used_bytes"),
        chosen_fits=at_chosen.get("fits"),
    )
    ctx.curves.append({"config": f"{name} s{seq}", "budget": budget_label(budget), "budget_bytes": budget_bytes,
                       "chosen": chosen, "points": sorted([(r["micro"], r["charged_bytes"]) for r in sweep.rows.values()
                                                            if "charged_bytes" in r] +
                                                           [(m, b) for m, b, _ in row["probe_points"]])})
    return row


def seeded_probe(model, seq: int, target: int, budget_bytes: int) -> dict[str, Any]:
    """The same probe started from the estimate (`probing.seed.probe_with_estimate`): its trials, its measured
    maximum, what the estimate said and how long it took (CPU time on fake tensors), or why it was skipped."""
    from hf_accum.probing.seed import probe_with_estimate

    said: list[str] = []
    start = time.perf_counter()
    try:
        result, _ = probe_with_estimate(model, seq_len=seq, target_batch_size=target, budget_bytes=budget_bytes,
                                        optimizer_cls=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-5},
                                        log=said.append)
    except ValueError as exc:
        return {"seeded_error": str(exc).splitlines()[0]}
    estimate = result.extra.get("estimate")
    return {"seeded_probe_seconds": time.perf_counter() - start, "seeded_trials": len(result.measured_trials),
            "seeded_trial_sizes": [t.micro_batch_size for t in result.trials],
            "seeded_max": result.max_micro_batch_size,
            "estimate_largest_fit": None if estimate is None else estimate["largest_fit"],
            "estimate_seconds": None if estimate is None else estimate["seconds"],
            "estimate_peaks": None if estimate is None else estimate["peaks"],
            "estimate_line": next((line for line in said if line.startswith("estimate")), None)}


def methods(ctx: Ctx) -> tuple[list[str], dict[str, str]]:
    skipped = {}
    names = ["full", "lora"]
    if ctx.cuda:
        try:
            import bitsandbytes  # noqa: F401

            names.append("qlora")
        except ImportError as exc:
            skipped["qlora"] = f"bitsandbytes is not importable ({exc}); QLoRA rows skipped"
    else:
        skipped["qlora"] = "QLoRA skipped on CPU (--quick): bitsandbytes' 4-bit path is measured on CUDA only"
    return names, skipped


def section_probe(ctx: Ctx) -> dict[str, Any]:
    names, skipped = methods(ctx)
    if ctx.s.grid2 is not None:
        names = [m for m in names if any(g[0] == m for g in ctx.s.grid2)]
    for reason in skipped.values():
        print(f"  [2] {reason}", flush=True)
    rows, skipped_rows, durations = [], [], []
    for i, method in enumerate(names):
        configs = [(ckpt, seq, budget) for seq in ctx.s.seqs for ckpt in (False, True) for budget in ctx.s.budgets]
        if ctx.s.grid2 is not None:
            configs = [(c, q, ctx.s.budgets[b]) for m, c, q, b in ctx.s.grid2 if m == method]
        labels = [(f"{method}{'+ckpt' if ckpt else ''}", seq, budget_label(budget)) for ckpt, seq, budget in configs]
        if ctx.clock.out():  # not even built
            skipped_rows += [{"config": n, "seq_len": q, "budget": b, "reason": "time limit"} for n, q, b in labels]
            continue
        method_end = ctx.clock.slice(len(names) - i)
        try:
            model = ctx.method_model(method)
        except Exception as exc:  # e.g. a bitsandbytes that imports but cannot quantize here: a finding, go on
            rows += [{"config": n, "seq_len": q, "budget": b, "error": f"building the model: {_error(exc)}"}
                     for n, q, b in labels]
            continue
        try:
            for j, ((ckpt, seq, budget), (name, _, label)) in enumerate(zip(configs, labels)):
                need = typical(durations)
                if ctx.clock.out(need) or (method_end is not None and time.monotonic() + need > method_end):
                    skipped_rows.append({"config": name, "seq_len": seq, "budget": label, "reason": "time limit"})
                    continue
                left = None if method_end is None else (method_end - time.monotonic()) / (len(configs) - j)
                end = None if left is None else time.monotonic() + left
                started = time.monotonic()
                try:
                    set_checkpointing(model, ckpt)
                    row = probe_and_sweep(ctx, model, name, seq, budget, end)
                except Exception as exc:  # one configuration's failure is its row's finding
                    row = {"config": name, "seq_len": seq, "budget": label, "error": _error(exc)}
                    free_memory()
                durations.append(time.monotonic() - started)
                rows.append(row)
                print(f"  [2] {_row_line(row)}", flush=True)
        finally:
            release(model)
            del model
            free_memory()
    goals = []
    done = [r for r in rows if "chosen_micro" in r]
    if done:
        fits = [r.get("chosen_fits") for r in done if r.get("chosen_fits") is not None]
        goals.append(goal("every chosen micro-batch fits its budget (sweep)", f"{sum(fits)}/{len(fits)}",
                          "all", all(fits) if fits else None))
        ratios = [r["reported_max"] / r["largest_really_fitting"] for r in done
                  if r.get("largest_really_fitting") and not r.get("largest_is_cap")]
        goals.append(goal("reported max / largest really fitting (worst)", min(ratios) if ratios else None,
                          ">= 0.9 (not at the cap)", min(ratios) >= 0.9 if ratios else None))
        goals.append(goal("mean probe trials", statistics.fmean(r["probe_trials"] for r in done), "info", None))
        seeded = [r for r in done if "seeded_trials" in r]
        if seeded:
            mean = statistics.fmean(r["seeded_trials"] for r in seeded)
            goals.append(goal("mean probe trials seeded by the estimate", mean, "<= 2", mean <= 2))
            same = sum(r["seeded_max"] == r["reported_max"] for r in seeded)
            goals.append(goal("seeded probe's measured max = the probe's", f"{same}/{len(seeded)}", "info", None))
    return {"figures": {"rows": rows, "not_run": skipped_rows, "skipped": skipped}, "goals": goals,
            "partial": bool(skipped_rows)}


def _row_line(row: dict) -> str:
    if "chosen_micro" not in row:
        return f"{row['config']} s{row['seq_len']} {row['budget']}: {row.get('error', row.get('reason'))}"
    return (f"{row['config']} s{row['seq_len']} {row['budget']}: chosen {row['chosen_micro']}, reported max "
            f"{row['reported_max']}, really fits {row.get('largest_really_fitting')}"
            f"{' (cap)' if row.get('largest_is_cap') else ''}, probe {row['probe_seconds']:.1f} s / "
            f"{row['probe_trials']} trials"
            + (f"; from the estimate ({row.get('estimate_largest_fit') or 'skipped'}): {row['seeded_trials']} "
               f"trials, max {row['seeded_max']}" if "seeded_trials" in row else ""))
