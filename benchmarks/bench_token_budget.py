"""micro_batching "samples" vs "tokens" on long-tailed lengths, side by side (CPU).

Data (fixed): 2048 examples, lengths lognormal (median 60, sigma 1.0) clipped to [8, 512], seed 0, and every 256th
example at 512; target 64 (one rank); the budget at which "samples" fits 4 worst-case rows: 4 x 512 tokens.

Part 1 (pure, every window of one epoch in the sampler's order): forwards per optimizer step and padded/real
tokens for "samples" (micro 4, each micro-batch padded to its longest), "tokens" (padded rows sorted and cut
under the budget: the fewest forwards, and the padding rule of a plan without step times, more while a window pads more than 1.10 tokens per real
one) and "tokens" on padding-free rows. Part 2 (a tiny float64 Llama, 6 windows): the tokens-mode probe
gives the token budget and the step-time model (`step_time.fit_step_time`); then every candidate cut (a number of
forwards per window, the fewest to "samples" mode's count), the planner's choice, the padding rule and "samples" mode
are trained through AccumTrainer from the same weights: forwards and padded/real tokens per step as the model saw
them, the modelled and the measured CPU seconds per optimizer step side by side, and the largest relative difference
of their gradients from "samples" mode's; the last line says whether the planner's cut is within 3% of the fastest
measured one. Part 3 (a small float32 Llama whose activations dominate, as in bench_probe.py; the
whole dataset): the memory budget is set halfway between the measured training peaks at 4 and 5 rows x 512
tokens (measured as below), so "samples" fits 4 worst-case rows; then
- AccumTrainer's probe in "tokens" mode gives the token budget and its cost model (trials and seconds next to the
  "samples" probe's);
- the largest chunk that really fits at each of several padded lengths is found independently of the probe: plain
  training (the plan given) on that many distinct padded rows, measured by the meter (rows bisected, peaks are
  monotone), capped at the window's 64 rows; the probe's admitted chunk at that length (the rows the plan's token
  budget and cost model admit, at most 64) is compared with it;
- both modes train 4 optimizer steps under the CPU meter: peak (tensor bytes, weights, gradients and optimizer
  state included) vs the budget.

Part 4 (only with ``--part 4``; a diagnostic of the step-time model): one window of 64 equal rows cut into 1, 2, 4, 8
and 16 forwards, trained through AccumTrainer beside the probe's bare step: what one forward more costs at each size.

    python benchmarks/bench_token_budget.py           # parts 1-3, about 15 minutes on 2 CPU cores
    python benchmarks/bench_token_budget.py --part 3
    python benchmarks/bench_token_budget.py --part 4  # about 2 minutes
"""

import dataclasses
import logging
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hf_accum.window.token_budget import TokenBudget, padded_tokens, partition_packed, partition_padded  # noqa: E402

TARGET, MICRO, LONGEST = 64, 4, 512
STEPS = 6  # part 2: optimizer steps (windows) per timed run
BUDGET = MICRO * LONGEST


def lengths(n=2048, seed=0):
    g = random.Random(seed)
    out = [min(512, max(8, round(math.exp(math.log(60) + g.gauss(0, 1.0))))) for _ in range(n)]
    for i in range(0, n, 256):
        out[i] = 512
    return out


def part1():
    lens = lengths()
    order = list(range(len(lens)))
    random.Random(1).shuffle(order)
    windows = [[lens[i] for i in order[w:w + TARGET]] for w in range(0, len(order), TARGET)]
    real = sum(lens)
    s_fwd = s_pad = f_fwd = 0
    for w in windows:
        for m in range(0, len(w), MICRO):
            chunk = w[m:m + MICRO]
            s_fwd += 1
            s_pad += len(chunk) * max(chunk)
        f_fwd += len(partition_packed(w, BUDGET))
    cuts = {}
    # before: the fewest forwards, then the least padding; now: more forwards while a window pads > 1.10 x
    for name, budget in (("before", TokenBudget(BUDGET, padding_target=None)), ("now", TokenBudget(BUDGET))):
        cuts[name] = [partition_padded(w, budget) for w in windows]
    again = [partition_padded(w, TokenBudget(BUDGET)) for w in windows]

    def padded(name):
        return sum(padded_tokens(w, g) for w, g in zip(windows, cuts[name])) / real

    steps = len(windows)
    rows = [("samples (micro 4)", s_fwd / steps, s_pad / real),
            ("tokens, fewest forwards", sum(map(len, cuts["before"])) / steps, padded("before")),
            ("tokens, padding <= 1.10", sum(map(len, cuts["now"])) / steps, padded("now")),
            ("tokens, padding-free", f_fwd / steps, 1.0)]
    print(f"Part 1: {len(lens)} examples, {steps} optimizer steps of {TARGET}, budget {BUDGET} tokens per forward")
    print(f"{'mode':24} {'forwards/step':>14} {'padded/real':>12} {'forwards vs samples':>20}")
    for name, fwd, pad in rows:
        print(f"{name:24} {fwd:14.2f} {pad:12.3f} {fwd / rows[0][1]:20.3f}")
    worst = max(padded_tokens(w, g) / sum(w) for w, g in zip(windows, cuts["now"]))
    print(f"padding <= 1.10: worst window {worst:.3f}; the same cuts when run again: {again == cuts['now']}")


def tiny_data():
    g = random.Random(2)
    lens = lengths(STEPS * TARGET, seed=3)
    data = []
    for n in lens:
        ids = [g.randint(1, 96) for _ in range(n)]
        data.append({"input_ids": ids, "labels": [-100] * (n // 4) + ids[n // 4:]})
    return data


def peak_of(model, rows, length, vocab):
    """The meter's peak over two optimizer steps of plain training (the plan given, no probe) on ``rows`` distinct
    rows of ``length`` tokens, the last shorter so that the batch is padded as training's are."""
    import copy
    import tempfile

    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.probing.meters import CpuMeter, live_tensor_bytes
    from tests.exactness import pad_collate

    g = random.Random(rows * 1000 + length)
    batch = []
    for r in range(rows):
        n = length - length // 4 if r == rows - 1 and rows > 1 else length
        ids = [g.randint(1, vocab) for _ in range(n)]
        batch.append({"input_ids": ids, "labels": [-100] * (n // 4) + ids[n // 4:]})
    with tempfile.TemporaryDirectory() as out:
        args = AccumTrainingArguments(
            output_dir=out, per_device_train_batch_size=rows, gradient_accumulation_steps=1, target_batch_size=rows,
            auto_tune=False, max_steps=2, learning_rate=1e-4, report_to=[], save_strategy="no", use_cpu=True, seed=0,
            disable_tqdm=True, remove_unused_columns=False)
        trainer = AccumTrainer(model=copy.deepcopy(model), args=args, train_dataset=batch, data_collator=pad_collate)
        trainer.remove_callback(PrinterCallback)
        meter = CpuMeter(resident=lambda model=trainer.model: live_tensor_bytes(model))
        return meter.measure(trainer.train).peak_bytes


def step_timer():
    """A Trainer callback holding the CPU seconds of each optimizer step (``.seconds``), from the Trainer's step
    beginning (the window's first batch is loaded after it) to its end (after the optimizer step). Built on first
    use: part 1 imports no transformers."""
    from transformers.trainer_callback import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.process_time() - self._start)

    return StepTimer()


def part2(passes=5, kernel="torch"):
    """The tokens-mode probe of the tiny float64 Llama (memory budget halfway between real steps of 4 and 5 rows x
    512, levers pinned off so that only the cut differs) gives the token budget and the step-time model; then the
    first STEPS windows are trained from the same weights with every candidate cut (a number of forwards per window,
    from the fewest to "samples" mode's count, each the cut partition_padded would take at that count), the
    planner's own choice, the padding rule (a plan without step times) and "samples" mode. Each is run ``passes``
    times, interleaved (every other pass in reverse order); each window (the same rows, cut the same way, in every pass)
    keeps its least CPU seconds over the passes, and a case's seconds per step are their mean: CPU time of one
    thread from each optimizer step's beginning to its end (the Trainer's setup left out), so that the other vCPU's
    load moves it as little as it can (with two threads, OpenMP's waiting threads count as CPU time too). ``kernel="auto"`` (``--kernel
    auto``): the loss kernel is not pinned, so the probe measures the budget under each kernel that runs and plans
    the one whose whole steps model least (issue 57 item 2); it prints each kernel's figures, and the runs train
    with the chosen kernel."""
    import copy
    import tempfile
    from unittest import mock

    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.planning import planner
    from hf_accum.window import step_time
    from hf_accum.window import token_budget as tb
    from tests.exactness import StepRecorder, max_relative_error, pad_collate, tiny_llama

    torch.set_num_threads(1)  # the probe's step times and the runs' alike
    data = tiny_data()
    initial = tiny_llama(max_position_embeddings=512)
    pinned = "checkpointing=0,selective=0"  # the cut is what differs; no layer lever is searched
    pinned += "" if kernel == "auto" else f",loss_kernel={kernel}"
    budget_bytes = (peak_of(initial, MICRO, LONGEST, 96) + peak_of(initial, MICRO + 1, LONGEST, 96)) // 2
    with tempfile.TemporaryDirectory() as out:
        args = AccumTrainingArguments(
            output_dir=out, target_batch_size=TARGET, micro_batching="tokens", memory_budget_bytes=budget_bytes,
            levers=pinned, max_steps=STEPS, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
            remove_unused_columns=False, log_level="warning")
        prober = AccumTrainer(model=copy.deepcopy(initial), args=args, train_dataset=data, data_collator=pad_collate)
        start = time.perf_counter()
        prober.tune()
        probe_s = time.perf_counter() - start
        plan = prober.plan
        timed = prober.probe_result.extra["token_budget"]["step_times"]
        optimizer = prober.probe_result.extra["token_budget"]["optimizer_step_seconds"]
        del prober
    budget = tb.plan_budget(plan)
    st = plan.step_time
    print(f"\nPart 2: tiny float64 Llama, {STEPS} optimizer steps of {TARGET}; memory budget {budget_bytes / 2**20:.1f} MiB")
    print(f"probe ({probe_s:.0f} s): {plan.describe()}")
    record = (plan.levers or {}).get("loss_kernel") or {}
    for name, tokens in (record.get("tokens_per_forward") or {}).items():  # kernel="auto": each kernel's budget
        print(f"  kernel {name}: {tokens} tokens per forward, {record['forwards_per_step'][name]:.2f} forwards/step, "
              f"modelled {record.get('step_seconds', {}).get(name, float('nan')):.3f} s/step"
              + (" (chosen)" if name == record["kernel"] else ""))
    kernel_in_force = record.get("kernel", kernel)  # the runs train with the plan's kernel
    print(f"timed steps of one forward (s): {timed}; the optimizer's step alone: {optimizer}")
    if st is None:
        print("no step-time model: the planner cuts by the padding rule")
        return
    print(f"step-time model: the optimizer's step {st['optimizer_seconds']:.4f} s; a forward (s) by length and rows: "
          + "; ".join(f"{k}: " + ", ".join(f"{r} {v:.4f}" for r, v in by_rows.items())
                      for k, by_rows in st["forward_seconds_by_rows"].items()))
    forwards_model = step_time.Forwards(st)

    own = tb.partition_padded

    known_cuts = {}  # a window's candidate cuts, computed once: a forced run's step pays no planning the planner skips

    def forced(count):  # the time rule's cut at ``count`` forwards (clamped to this window's candidates)
        def cut(lengths, budget, groups=None):
            key = (tuple(lengths), id(budget))
            if key not in known_cuts:
                known_cuts[key] = tb.candidate_cuts(lengths, budget)
            cands = known_cuts[key]
            return cands[max(min(cands), min(max(cands), max(count, groups or 0)))]
        return cut

    def run(mode, in_force, partition):
        with tempfile.TemporaryDirectory() as out, mock.patch.object(planner, "plan_budget", in_force), \
                mock.patch.object(tb, "partition_padded", partition):
            args = AccumTrainingArguments(
                output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=TARGET // MICRO,
                target_batch_size=TARGET, auto_tune=False, micro_batching=mode,
                max_tokens_per_forward=plan.token_budget if mode == "tokens" else None, max_steps=STEPS,
                learning_rate=1e-3, max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                disable_tqdm=True, remove_unused_columns=False, log_level="error", check_accumulation=False,
                levers=f"loss_kernel={kernel_in_force}")
            recorder = StepRecorder()
            model = copy.deepcopy(initial)
            shapes = []
            model.register_forward_pre_hook(lambda m, a, kw, seen=shapes: seen.append(tuple(kw["input_ids"].shape)),
                                            with_kwargs=True)
            trainer = AccumTrainer(model=model, args=args, train_dataset=data, data_collator=pad_collate,
                                   callbacks=[recorder])
            trainer.remove_callback(PrinterCallback)
            timer = step_timer()
            trainer.add_callback(timer)
            trainer.train()
            seconds = list(timer.seconds)
        modelled = STEPS * forwards_model.optimizer + sum(forwards_model.cost(length, rows) for rows, length in shapes)
        real = sum(len(d["input_ids"]) for d in data)
        return recorder, seconds, len(shapes) / STEPS, sum(r * n for r, n in shapes) / real, modelled / STEPS

    with_time = lambda _plan: budget  # noqa: E731 -- the probed plan's budget, step times included
    padding_rule = lambda _plan: dataclasses.replace(budget, step_time=None)  # noqa: E731
    windows = [[len(d["input_ids"]) for d in data[w:w + TARGET]] for w in range(0, len(data), TARGET)]
    counts = sorted({g for w in windows for g in tb.candidate_cuts(w, budget)})
    cases = {"samples": ("samples", with_time, own)}
    cases.update({f"{g} forwards": ("tokens", with_time, forced(g)) for g in counts})
    cases.update({"planner (step time)": ("tokens", with_time, own), "padding rule (1.10)": ("tokens", padding_rule, own)})
    logging.getLogger("hf_accum").setLevel(logging.ERROR)  # the runs' budgets are patched in: no plan line, no rule note
    results, every = {}, {}
    for p in range(passes):
        for name, case in (cases.items() if p % 2 == 0 else reversed(cases.items())):
            rec, seconds, *rest = run(*case)
            every.setdefault(name, []).append(sum(seconds) / len(seconds))
            # each window (the same rows, cut the same way, in every pass) keeps its least time over the passes
            least = seconds if name not in results else [min(a, b) for a, b in zip(results[name][1], seconds)]
            results[name] = (rec, least, *rest)
    results = {name: (rec, sum(least) / len(least), *rest) for name, (rec, least, *rest) in results.items()}
    print(f"{'cut':22} {'forwards/step':>14} {'padded/real':>12} {'modelled s':>11} {'CPU s/step':>11} "
          f"{'median/least':>13} {'vs fastest':>11} {'grad vs samples':>16}")
    tokens = {k: v for k, v in results.items() if k != "samples"}
    # the candidates: every cut tokens mode could take (each count of forwards, and the padding rule's), not the planner
    best = min((k for k in tokens if k != "planner (step time)"), key=lambda k: tokens[k][1])
    fastest = tokens[best][1]
    for name, (rec, seconds, fwd, pad, modelled) in results.items():
        err = "" if name == "samples" else f"{max_relative_error(rec.grads, results['samples'][0].grads):.1e}"
        spread = sorted(every[name])[len(every[name]) // 2] / seconds
        print(f"{name:22} {fwd:14.2f} {pad:12.3f} {modelled:11.3f} {seconds:11.3f} {spread:13.3f} "
              f"{seconds / fastest:11.3f} {err:>16}")
    chosen = tokens["planner (step time)"][1]
    print(f"planner's cut: {tokens['planner (step time)'][2]:.2f} forwards/step, {chosen:.3f} CPU s/step; fastest "
          f"measured candidate: {best} ({tokens[best][1]:.3f}); planner / fastest {chosen / fastest:.3f} "
          f"({'within' if chosen <= 1.03 * fastest else 'NOT within'} 3%)")


def examples(lens, seed=3):
    g = random.Random(seed)
    rows = []
    for n in lens:
        ids = [g.randint(1, 250) for _ in range(n)]
        rows.append({"input_ids": ids, "labels": [-100] * (n // 4) + ids[n // 4:]})
    return rows


def part3():
    import copy
    import tempfile

    from transformers.trainer_callback import PrinterCallback

    from benchmarks.bench_probe import small_llama
    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.probing.meters import CpuMeter, live_tensor_bytes
    from hf_accum.window.token_budget import TokenBudget
    from tests.exactness import pad_collate

    data = examples(lengths())
    initial = small_llama()

    def arguments(out, mode, budget):
        return AccumTrainingArguments(
            output_dir=out, target_batch_size=TARGET, micro_batching=mode, memory_budget_bytes=budget, max_steps=4,
            learning_rate=1e-4, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
            remove_unused_columns=False)

    def measured_steps(length):
        """``peak(rows)``: the meter's peak over two real optimizer steps of plain training (AccumTrainer with the
        plan given, no probe) on ``rows`` distinct rows of ``length`` tokens, the last one shorter so that the
        batch is padded as training's are."""
        cache = {}

        def peak(rows):
            if rows not in cache:
                g = random.Random(rows * 1000 + length)
                batch = []
                for r in range(rows):
                    n = length - length // 4 if r == rows - 1 and rows > 1 else length
                    ids = [g.randint(1, 250) for _ in range(n)]
                    batch.append({"input_ids": ids, "labels": [-100] * (n // 4) + ids[n // 4:]})
                with tempfile.TemporaryDirectory() as out:
                    args = AccumTrainingArguments(
                        output_dir=out, per_device_train_batch_size=rows, gradient_accumulation_steps=1,
                        target_batch_size=rows, auto_tune=False, max_steps=2, learning_rate=1e-4, report_to=[],
                        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False)
                    trainer = AccumTrainer(model=copy.deepcopy(initial), args=args, train_dataset=batch,
                                           data_collator=pad_collate)
                    trainer.remove_callback(PrinterCallback)
                    meter = CpuMeter(resident=lambda model=trainer.model: live_tensor_bytes(model))
                    cache[rows] = meter.measure(trainer.train).peak_bytes
            return cache[rows]
        return peak

    at_longest = measured_steps(LONGEST)
    budget = (at_longest(MICRO) + at_longest(MICRO + 1)) // 2
    print(f"\nPart 3: small float32 Llama, memory budget {budget / 2**20:.1f} MiB (halfway between real steps of "
          f"{MICRO} and {MICRO + 1} rows x {LONGEST})")

    trainers, train_peaks = {}, {}
    for mode in ("samples", "tokens"):
        with tempfile.TemporaryDirectory() as out:
            trainer = AccumTrainer(model=copy.deepcopy(initial), args=arguments(out, mode, budget), train_dataset=data,
                                   data_collator=pad_collate)
            trainer.remove_callback(PrinterCallback)
            start = time.perf_counter()
            trainer.tune()
            probe_s = time.perf_counter() - start
            extra = trainer.probe_result.extra.get("token_budget", {})
            trials = len(trainer.probe_result.measured_trials) + len(extra.get("short_trials", []))
            meter = CpuMeter(resident=lambda model=trainer.model: live_tensor_bytes(model))
            train_peaks[mode] = meter.measure(trainer.train).peak_bytes
            trainers[mode] = (trainer, trials, probe_s)
    samples, tokens = trainers["samples"][0], trainers["tokens"][0]
    admits = TokenBudget(tokens.plan.token_budget, tokens.plan.token_model)  # what the engine cuts by
    print(f"samples plan: {samples.plan.describe()}; tokens plan: {tokens.plan.describe()}")
    for mode, (_, trials, probe_s) in trainers.items():
        print(f"probe ({mode}): {trials} measured trials, {probe_s:.1f} s")
    model = tokens.probe_result.extra["token_budget"]["cost_model"]
    if model:
        print(f"cost model: peak ~ {model['base_bytes'] / 2**20:.1f} MiB + rows x ({model['per_row_bytes'] / 1024:.2f} "
              f"KiB + {model['per_token_bytes'] / 1024:.2f} KiB x length + {model['per_token_sq_bytes']:.2f} B x "
              f"length^2), lengths {model['lengths']}")

    print(f"\n{'length':>7} {'admitted rows':>14} {'fit rows':>9} {'admitted/fit':>13}")
    worst = 1.0
    for length in (LONGEST, 256, 128, 64, 32):
        peak = measured_steps(length)
        admitted = min(TARGET, admits.rows(length))
        lo, hi = 0, TARGET + 1  # peak(lo) fits, peak(hi) does not (or hi is beyond the window)
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if peak(mid) <= budget else (lo, mid)
        worst = min(worst, admitted / lo)
        print(f"{length:>7} {admitted:>14} {lo:>9} {admitted / lo:>13.3f}")
    print(f"largest chunk admitted vs largest that fits: worst {worst:.3f} over these lengths (goal >= 0.95)")
    for mode, peak in train_peaks.items():
        print(f"training peak ({mode}, 4 steps, meter): {peak / 2**20:.1f} MiB = {peak / budget:.3f} x budget")


def part4(passes=3, lengths=(32, 128), ks=(1, 2, 4, 8, 16)):
    """What one forward more costs (issue 57): one window of TARGET rows of equal length (no padding, so only the
    number of forwards differs), cut into k forwards by the token budget (``max_tokens_per_forward`` = TARGET x
    length / k), trained through AccumTrainer (least CPU seconds per optimizer step over ``passes`` interleaved runs
    of 4 steps, the first step left out), beside the probe's bare step (`probe.make_step_fn`, the same rows in k
    forwards, least of 5). The step-time model charges every forward one fixed cost; this prints what a forward more
    costs at each size."""
    import copy
    import tempfile

    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments
    from hf_accum.probing.probe import make_step_fn
    from tests.exactness import pad_collate, tiny_llama

    steps = 4

    torch.set_num_threads(1)
    logging.getLogger("hf_accum").setLevel(logging.ERROR)
    initial = tiny_llama(max_position_embeddings=512)
    print(f"\nPart 4: one window of {TARGET} equal rows cut into k forwards (CPU s per optimizer step, 1 thread)")
    for length in lengths:
        g = random.Random(length)
        data = [{"input_ids": ids, "labels": ids} for ids in
                ([g.randint(1, 96) for _ in range(length)] for _ in range(TARGET * steps))]

        def trained(k, data=data, length=length):
            with tempfile.TemporaryDirectory() as out:
                args = AccumTrainingArguments(
                    output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=TARGET // MICRO,
                    target_batch_size=TARGET, auto_tune=False, micro_batching="tokens",
                    max_tokens_per_forward=TARGET * length // k, max_steps=steps, learning_rate=1e-3,
                    max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                    remove_unused_columns=False, log_level="error", check_accumulation=False,
                    levers="loss_kernel=torch")
                trainer = AccumTrainer(model=copy.deepcopy(initial), args=args, train_dataset=data,
                                       data_collator=pad_collate)
                trainer.remove_callback(PrinterCallback)
                timer = step_timer()
                trainer.add_callback(timer)
                trainer.train()
                return min(timer.seconds[1:])

        def bare(k, data=data):
            model = copy.deepcopy(initial)
            step = make_step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                lambda rows: pad_collate(data[:rows]))
            step(TARGET)
            best = math.inf
            for _ in range(5):
                start = time.process_time()
                step(TARGET, forwards=k)
                best = min(best, time.process_time() - start)
            return best

        runs = {k: math.inf for k in ks}
        for p in range(passes):
            for k in (ks if p % 2 == 0 else ks[::-1]):
                runs[k] = min(runs[k], trained(k))
        plain = {k: bare(k) for k in ks}
        print(f"length {length}: " + "; ".join(f"k={k}: training {runs[k]:.4f}, bare {plain[k]:.4f}" for k in ks))
        top = ks[-1]
        print(f"  a forward more, k=1 -> {top}: training {(runs[top] - runs[1]) / (top - 1) * 1e3:.1f} ms, bare "
              f"{(plain[top] - plain[1]) / (top - 1) * 1e3:.1f} ms; k=1 -> 2: training "
              f"{(runs[2] - runs[1]) * 1e3:.1f} ms, bare {(plain[2] - plain[1]) * 1e3:.1f} ms")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--part", type=int, choices=(1, 2, 3, 4))
    parser.add_argument("--kernel", default="torch", help="part 2's loss kernel: a name, or 'auto' (chosen with "
                        "the token budget by whole steps)")
    parser.add_argument("--passes", type=int, default=5, help="part 2: runs of each cut, the least kept")
    parsed = parser.parse_args()
    chosen = parsed.part
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for number, part in ((1, part1), (2, lambda: part2(passes=parsed.passes, kernel=parsed.kernel)), (3, part3),
                         (4, part4)):
        if chosen in (None, number) and (number != 4 or chosen == 4):  # part 4 (a diagnostic) only when asked
            part()
