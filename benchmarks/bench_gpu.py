"""One command that checks hf_accum's plan on a GPU; writes one JSON (every figure) and one PNG, prints a table.

    python benchmarks/bench_gpu.py --out DIR            # CUDA: a ~1B Llama from config in bf16 (built for < 9 min)
    python benchmarks/bench_gpu.py --quick --out DIR    # CPU, a tiny Llama: every section, well under a minute
    python benchmarks/bench_gpu.py --sections 2,5 --minutes 4 --out DIR

Sections (each writes its figures and its goals with pass/fail flags into DIR/bench_gpu.json as soon as it ends):
  1 model       a Llama from config (hidden 2048, 16 layers, vocab 128256; no hub) in bf16: parameters, build time,
                weights' memory, one training step's loss (finite);
  2 probe       for full fine-tuning (AdamW), LoRA and QLoRA (where bitsandbytes imports), checkpointing off/on,
                two sequence lengths, two budgets: hf_accum.probing.probe.probe_model's chosen micro-batch, reported maximum,
                seconds and trials, then an exhaustive sweep of real steps around the choice (the largest size that
                really fits, peak allocated, torch.cuda.max_memory_reserved, NVML's used memory per size);
  3 train       AccumTrainer (auto_tune) trains each plan (tight budget and long sequences first, as many as the time
                allows) for 50 steps on long-tailed data whose longest example is the probe's worst case: OOMs seen
                (goal 0), peak reserved vs the budget;
  4 oom         a callback grabs device memory before a window (on CPU: an injected torch.OutOfMemoryError, since
                a real one kills the process): the run recovers with the same effective batch, every sample once;
  5 throughput  tokens/s at the plan vs the best divisor vs micro 1 (steady-state AccumTrainer steps), MFU against
                the device's bf16 peak (hf_accum.probing.flops), AccumTrainer / Trainer step time at the same micro x
                accumulation, interleaved rounds (goal <= 1.01);
  6 tokens      micro_batching "tokens" vs "samples" on long-tailed lengths (forwards, padded tokens, s/step, peak),
                and the fused loss on vs off at one micro-batch (peak, s/step);
  7 estimate    the estimate (fake tensors) beside the measured peaks;
  8 levers      micro-batch x per-layer level (none / full or selective checkpointing / activation offload of k in
                {L/2, L} layers, offload CUDA only) at seq 2048: step time (fastest of 3) and peak allocated and
                reserved per point, an OOM recorded as "OOM"; then AccumTrainer's tuner (checkpoint_layers='auto') under
                a budget that only partly checkpointed levels fit, its choice measured the same way. At most cap8
                seconds (180 on the GPU: ~3 min on an H100): python benchmarks/bench_gpu.py --sections 8 --minutes 4
A section that needs a missing package (bitsandbytes, NVML, matplotlib) skips that part with a line saying so.
--minutes N: sections share the time left; one that runs out stops cleanly, keeps what it measured and says so.
--quick: CPU and float32 even where CUDA exists; figures that only CUDA has are null with the reason.
Plan fields are read through Plan.to_dict() (rows_per_forward, checkpointed_layers, ... where the Plan has them).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from hf_accum.probing import flops  # noqa: E402
from hf_accum.probing.meters import CpuMeter, CudaMeter, Meter, live_tensor_bytes  # noqa: E402
from hf_accum.probing.plan import divisors  # noqa: E402
from hf_accum.probing.probe import make_step_fn, probe_model, random_token_batch, resolve_budget  # noqa: E402
from hf_accum.window.oom import free_memory, is_oom  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
JSON_NAME, PNG_NAME = "bench_gpu.json", "bench_gpu.png"
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SECTION_NAMES = {1: "model", 2: "probe", 3: "train", 4: "oom", 5: "throughput", 6: "tokens", 7: "estimate",
                 8: "levers", 9: "loss_kernels"}
SHARES = {1: 0.04, 2: 0.38, 3: 0.19, 4: 0.08, 5: 0.13, 6: 0.11, 7: 0.07, 8: 0.2, 9: 0.03}  # of the time left, among the sections left


@dataclass
class Settings:
    """Every size the run uses: one set for the GPU, one for --quick (CPU)."""

    model: dict[str, Any]
    seqs: tuple[int, ...]
    budgets: tuple[tuple[str, float], ...]  # ("fraction", f): of the usable memory; ("x_peak1", k): k x peak at micro 1
    target: int  # section 2
    target3: int
    steps3: int
    target4: int
    steps4: int
    seq5: int
    target5: int
    timed5: int  # steady-state steps timed per run (after 2 warm-up steps)
    rounds5: int
    seq6: int
    target6: int
    steps6: int
    micro6: int
    minutes: float | None
    grid2: tuple[tuple[str, bool, int, int], ...] | None = None  # (method, checkpointing, seq, budget index); None: all
    plans3: int | None = None  # how many of section 2's configurations section 3 trains (None: as time allows)
    warm5: int = 2  # steps not timed at the start of each run
    sweep5: int | None = None  # how many divisors section 5 times (None: every one up to the plan's)
    seq8: int = 2048
    micros8: tuple[int, ...] = (1, 2, 4, 8, 16)
    target8: int = 16  # the tuner's samples per optimizer step in section 8
    cap8: float = 180.0  # section 8's own limit in seconds (a quarter kept for the tuner), whatever --minutes leaves
    seeded2: bool = True  # section 2 also probes from the estimate (probing.seed) and counts its trials


GPU = Settings(
    model=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=True,
               rope_theta=500000.0),
    seqs=(2048, 512), budgets=(("fraction", 0.35), ("fraction", 0.9)), target=32, target3=8, steps3=50, target4=16,
    steps4=6, seq5=512, target5=32, timed5=4, rounds5=5, seq6=2048, target6=32, steps6=6, micro6=4, minutes=8.5,
)
QUICK = Settings(
    model=dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, max_position_embeddings=256),
    seqs=(64, 32), budgets=(("x_peak1", 2.0), ("x_peak1", 5.0)), target=16, target3=16, steps3=3, target4=8,
    steps4=4, seq5=32, target5=8, timed5=2, rounds5=2, seq6=64, target6=16, steps6=2, micro6=4, minutes=None,
    # every method, checkpointing off and on, both lengths and both budgets, in four configurations (not all 16)
    grid2=(("full", False, 64, 0), ("full", True, 32, 1), ("lora", False, 32, 0), ("lora", True, 64, 1)),
    plans3=2, warm5=1, sweep5=2, seq8=32, micros8=(1, 2), target8=4, cap8=60.0,
)


# --- time ---------------------------------------------------------------------------------------------------------
class Clock:
    """The run's deadline (--minutes) and each section's share of the time left."""

    def __init__(self, minutes: float | None) -> None:
        self.start = time.monotonic()
        self.end = None if minutes is None else self.start + 60.0 * minutes
        self.section_end: float | None = None

    def left(self) -> float:
        ends = [e for e in (self.end, self.section_end) if e is not None]
        return math.inf if not ends else min(ends) - time.monotonic()

    def out(self, need: float = 0.0) -> bool:
        """True when less than ``need`` seconds are left: a unit of work that took ``need`` last time would overrun."""
        return self.left() <= need

    def open_section(self, number: int, remaining: list[int]) -> None:
        if self.end is None:
            self.section_end = None
            return
        share = SHARES[number] / sum(SHARES[n] for n in remaining)
        self.section_end = time.monotonic() + share * max(0.0, self.end - time.monotonic())

    def slice(self, parts: int) -> float | None:
        """An absolute end for one of ``parts`` equal parts of what is left (None: no limit)."""
        left = self.left()
        return None if math.isinf(left) else time.monotonic() + max(0.0, left) / max(1, parts)


def typical(seconds: list[float]) -> float:
    """What the next unit of work will likely take: the median of those done (0 before the first)."""
    return statistics.median(seconds) if seconds else 0.0


# --- the run's context ---------------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, settings: Settings, quick: bool, clock: Clock, out: str) -> None:
        self.s, self.quick, self.clock, self.out = settings, quick, clock, out
        self.cuda = torch.cuda.is_available() and not quick
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.results: dict[str, Any] = {}
        self.curves: list[dict[str, Any]] = []  # section 2's memory curves, for the PNG

    # memory facts --------------------------------------------------------------------------------------------------
    def meter(self, *holders) -> Meter:
        if self.cuda:
            return CudaMeter(self.device)
        return CpuMeter(resident=lambda: live_tensor_bytes(*holders))

    def reset_peak(self) -> None:
        if self.cuda:
            free_memory()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_reserved(self) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.device)) if self.cuda else None

    def num_ooms(self) -> int | None:
        return int(torch.cuda.memory_stats(self.device).get("num_ooms", 0)) if self.cuda else None

    def nvml_used(self) -> tuple[int | None, str | None]:
        """NVML's used memory of the whole device (what nvidia-smi shows), or None and why."""
        if not self.cuda:
            return None, "no CUDA device (CPU run)"
        try:
            import pynvml
        except ImportError:
            return None, "nvidia-ml-py (pynvml) is not importable"
        try:
            pynvml.nvmlInit()
            try:
                index = self.device.index or 0
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
                if visible and visible.split(",")[index].strip().isdigit():
                    index = int(visible.split(",")[index])
                return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used), None
            finally:
                pynvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001 - a fact we cannot get, never a reason to stop
            return None, f"NVML: {type(exc).__name__}: {exc}"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # models ----------------------------------------------------------------------------------------------------------
    def llama(self, seed: int = 0):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        with torch.device(self.device):
            model = LlamaForCausalLM(LlamaConfig(**self.s.model))
        return model.to(self.dtype)

    def method_model(self, method: str):
        """"full", "lora" or "qlora" (4-bit NF4 base through hf_accum.probing.loading, then the one LoRA preparation)."""
        if method == "full":
            return self.llama()
        from peft import LoraConfig

        from hf_accum.probing.loading import add_lora, load_model

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_MODULES, task_type="CAUSAL_LM")
        if method == "lora":
            return add_lora(self.llama(), lora, checkpointing=True)
        base = self.llama()
        with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
            base.save_pretrained(tmp)
            del base
            free_memory()
            quant = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                         bnb_4bit_compute_dtype=self.dtype)
            model = load_model(tmp, dtype=self.dtype, quantization=quant, device=self.device.index or 0)
        return add_lora(model, lora, quantized=True, checkpointing=True)

    def write(self) -> str:
        path = os.path.join(self.out, JSON_NAME)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=_json_default)
        os.replace(tmp, path)
        return path


def _json_default(value):
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, float | int):
        return value
    return repr(value)


def release(*objects) -> None:
    """Drop a section's models, optimizers and trainers and give their memory back before the next one."""
    for obj in objects:
        accelerator = getattr(obj, "accelerator", None)
        if accelerator is not None:
            accelerator.free_memory()
            obj.optimizer = obj.lr_scheduler = None  # a trainer keeps its optimizer's state (AdamW: 2x the weights)
    del objects
    free_memory()


def set_checkpointing(model, on: bool) -> None:
    """Gradient (activation) checkpointing on or off, under either name transformers gives it."""
    if on:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()


def checkpointing_args(on: bool) -> dict[str, Any]:
    from transformers import TrainingArguments

    names = {f for f in TrainingArguments.__dataclass_fields__}
    prefix = "activation" if "activation_checkpointing" in names else "gradient"
    return {f"{prefix}_checkpointing": on, f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}} if on else {}


def plan_facts(plan) -> dict[str, Any]:
    """The plan as data, read defensively: fields differ between versions (rows_per_forward, checkpointed_layers)."""
    if plan is None:
        return {}
    facts = dict(plan.to_dict()) if hasattr(plan, "to_dict") else {}
    facts["describe"] = plan.describe()
    for name in ("forwards",):
        value = getattr(plan, name, None)
        if isinstance(value, int | float):
            facts[name] = value
    # rows per forward: the uneven cut's m where the plan has it, else the micro-batch
    facts["rows_per_forward_effective"] = facts.get("rows_per_forward") or facts.get("micro_batch_size")
    facts["effective_batch"] = facts.get("target_batch_size")
    return facts


# --- data ---------------------------------------------------------------------------------------------------------
def long_tailed_lengths(n: int, longest: int, seed: int, every_longest: int = 16) -> list[int]:
    """Lognormal lengths (median longest / 8) clipped to [8, longest]; every ``every_longest``-th is the longest:
    the worst case the probe measures is in the data, and training meets it."""
    g = random.Random(seed)
    median = max(8, longest // 8)
    out = [min(longest, max(8, round(math.exp(math.log(median) + g.gauss(0, 1.0))))) for _ in range(n)]
    for i in range(0, n, every_longest):
        out[i] = longest
    g.shuffle(out)
    return out


def lm_rows(lengths: list[int], vocab: int, seed: int) -> list[dict[str, Any]]:
    g = random.Random(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = [g.randrange(1, vocab) for _ in range(n)]
        rows.append({"input_ids": ids, "labels": [-100] * (n // 4) + ids[n // 4:], "idx": i})
    return rows


class PadCollator:
    """Right-pads to the longest row; records which rows (``idx``) it collated, so a test of 'every sample once'
    reads what the Trainer really loaded."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, features):
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for r, f in enumerate(features):
            n = len(f["input_ids"])
            ids[r, :n] = torch.tensor(f["input_ids"])
            mask[r, :n] = 1
            labels[r, :n] = torch.tensor(f["labels"])
            if "idx" in f:
                self.seen.append(int(f["idx"]))
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# --- trainers -----------------------------------------------------------------------------------------------------
class StepTimes:
    """Wall time of each optimizer step (the device synchronized at each end, for every trainer alike)."""

    def __new__(cls, ctx: Ctx):
        from transformers import TrainerCallback

        class _StepTimes(TrainerCallback):
            def __init__(self):
                self.stamps: list[float] = []

            def on_step_begin(self, args, state, control, **kwargs):
                if not self.stamps:
                    ctx.sync()
                    self.stamps.append(time.perf_counter())

            def on_step_end(self, args, state, control, **kwargs):
                ctx.sync()
                self.stamps.append(time.perf_counter())

            def steady(self, skip: int = 2) -> float | None:
                gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])][skip:]
                return statistics.median(gaps) if gaps else None

        return _StepTimes()


class OOMLog(logging.Handler):
    """Counts hf_accum's 'out of memory at step' warnings: each is one recovered OOM."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "out of memory" in message:
            self.messages.append(message)


@contextlib.contextmanager
def oom_log():
    handler = OOMLog()
    logger = logging.getLogger("hf_accum")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def make_trainer(ctx: Ctx, model, rows, out: str, *, accum_trainer: bool = True, callbacks=(), collator=None,
                 **kwargs):
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_accum import AccumTrainer, AccumTrainingArguments

    common = dict(output_dir=out, report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True,
                  remove_unused_columns=False, learning_rate=1e-5, max_grad_norm=1.0, seed=0, use_cpu=not ctx.cuda,
                  dataloader_drop_last=True)
    common.update(kwargs)
    args = (AccumTrainingArguments if accum_trainer else TrainingArguments)(**common)
    trainer = (AccumTrainer if accum_trainer else Trainer)(
        model=model, args=args, train_dataset=rows, data_collator=collator or PadCollator(), callbacks=list(callbacks))
    trainer.remove_callback(PrinterCallback)
    return trainer


def budget_kwargs(ctx: Ctx, budget: tuple[str, float], peak1: Callable[[], int]) -> dict[str, Any]:
    kind, value = budget
    if kind == "fraction":
        return {"memory_budget": value}
    return {"memory_budget_bytes": int(value * peak1())}


def peak_at_one(ctx: Ctx, model, seq: int) -> int:
    """Charged bytes of one training step at micro-batch 1 (fresh AdamW, its state made by a warm-up step)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    step = make_step_fn(model, opt, random_token_batch(model, seq))
    try:
        step(1)
        return ctx.meter(model, opt).measure(lambda: step(1)).charged_bytes
    finally:
        opt.state.clear()
        model.zero_grad(set_to_none=True)
        del opt
        free_memory()


def budget_label(budget: tuple[str, float]) -> str:
    kind, value = budget
    return f"{value:g} of usable" if kind == "fraction" else f"{value:g} x peak(1)"


def goal(name: str, value, target: str, passed: bool | None) -> dict[str, Any]:
    return {"name": name, "value": value, "goal": target, "pass": passed}


# --- section 1: the model ------------------------------------------------------------------------------------------
def section_model(ctx: Ctx) -> dict[str, Any]:
    ctx.reset_peak()
    start = time.perf_counter()
    model = ctx.llama()
    ctx.sync()
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    weights = live_tensor_bytes(model, device_type=ctx.device.type)
    losses = []

    def forward(m, batch):
        loss = m(**batch).loss
        losses.append(float(loss.detach()))
        return loss

    step = make_step_fn(model, torch.optim.AdamW(model.parameters(), lr=1e-5), random_token_batch(model, 128),
                        forward=forward)
    start = time.perf_counter()
    step(1)
    ctx.sync()
    step_s = time.perf_counter() - start
    figures = {
        "config": dict(ctx.s.model), "dtype": str(ctx.dtype), "device": str(ctx.device), "parameters": params,
        "linear_parameters": flops.linear_parameters(model), "build_seconds": build_s, "weights_bytes": weights,
        "first_step_seconds_micro1_seq128": step_s, "first_step_loss": losses[0] if losses else None,
        "peak_reserved_bytes": ctx.peak_reserved(),
        "flops_per_token_seq2048": flops.training_flops_per_token(model, 2048),
    }
    release(model)
    ok = bool(losses) and math.isfinite(losses[0])
    return {"figures": figures, "goals": [goal("first step loss is finite", figures["first_step_loss"], "finite", ok)]}


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


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _row_line(row: dict) -> str:
    if "chosen_micro" not in row:
        return f"{row['config']} s{row['seq_len']} {row['budget']}: {row.get('error', row.get('reason'))}"
    return (f"{row['config']} s{row['seq_len']} {row['budget']}: chosen {row['chosen_micro']}, reported max "
            f"{row['reported_max']}, really fits {row.get('largest_really_fitting')}"
            f"{' (cap)' if row.get('largest_is_cap') else ''}, probe {row['probe_seconds']:.1f} s / "
            f"{row['probe_trials']} trials"
            + (f"; from the estimate ({row.get('estimate_largest_fit') or 'skipped'}): {row['seeded_trials']} "
               f"trials, max {row['seeded_max']}" if "seeded_trials" in row else ""))


# --- section 3: 50 steps at each plan ----------------------------------------------------------------------------
def train_at_plan(ctx: Ctx, model, ckpt: bool, seq: int, budget: tuple[str, float], steps: int, target: int,
                  out: str) -> dict[str, Any]:
    lengths = long_tailed_lengths(steps * target, seq, seed=seq + steps)
    rows = lm_rows(lengths, ctx.s.model["vocab_size"], seed=1)
    kw = budget_kwargs(ctx, budget, lambda: peak_at_one(ctx, model, seq))
    trainer = make_trainer(ctx, model, rows, out, target_batch_size=target, max_steps=steps,
                           **checkpointing_args(ckpt), **kw)
    try:
        start = time.perf_counter()
        plan = trainer.tune()
        probe_s = time.perf_counter() - start
        budget_bytes = trainer.probe_result.budget_bytes if trainer.probe_result is not None else None
        ooms_before = ctx.num_ooms()
        ctx.reset_peak()
        with oom_log() as log:
            start = time.perf_counter()
            if ctx.cuda:
                trainer.train()
                peak = ctx.peak_reserved()
            else:
                peak = CpuMeter(resident=lambda: live_tensor_bytes(model)).measure(trainer.train).peak_bytes
            train_s = time.perf_counter() - start
        used, why = ctx.nvml_used()
        return {
            "longest_example": max(lengths), "plan": plan_facts(plan), "plan_after": plan_facts(trainer.plan),
            "probe_seconds": probe_s, "train_seconds": train_s, "steps": trainer.state.global_step,
            "budget_bytes": budget_bytes, "peak_bytes": peak,
            "peak_kind": "torch.cuda.max_memory_reserved" if ctx.cuda else "CpuMeter peak (tensor bytes)",
            "peak_over_budget": peak / budget_bytes if peak and budget_bytes else None,
            "oom_warnings": len(log.messages),
            "allocator_ooms": None if ooms_before is None else ctx.num_ooms() - ooms_before,
            "nvml_used_bytes_end": used, **({"nvml_null_reason": why} if why else {}),
        }
    finally:
        release(trainer)
        model.zero_grad(set_to_none=True)
        free_memory()


def section_train(ctx: Ctx) -> dict[str, Any]:
    names, skipped = methods(ctx)
    # the most informative plans first: the tight budget, the long sequence; every method gets its turn
    order = [(method, ckpt, seq, budget) for budget in ctx.s.budgets for seq in ctx.s.seqs
             for method in names for ckpt in (False, True)]
    if ctx.s.grid2 is not None:
        order = [(m, c, q, ctx.s.budgets[b]) for m, c, q, b in ctx.s.grid2]
    if ctx.s.plans3 is not None:
        order = order[:ctx.s.plans3]
    rows, not_run, durations = [], [], []
    models: dict[str, Any] = {}
    failed: dict[str, str] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu3_") as tmp:
            for k, (method, ckpt, seq, budget) in enumerate(order):
                name = f"{method}{'+ckpt' if ckpt else ''}"
                if ctx.clock.out(typical(durations)):
                    not_run.append({"config": name, "seq_len": seq, "budget": budget_label(budget),
                                    "reason": "time limit"})
                    continue
                started = time.monotonic()
                row = {"config": name, "seq_len": seq, "budget": budget_label(budget)}
                if method in failed:
                    rows.append({**row, "error": failed[method]})
                    continue
                if method not in models:
                    for other in list(models):  # one model on the device at a time
                        release(models.pop(other))
                    try:
                        models[method] = ctx.method_model(method)
                    except Exception as exc:  # e.g. a bitsandbytes that imports but cannot quantize here
                        failed[method] = f"building the model: {_error(exc)}"
                        rows.append({**row, "error": failed[method]})
                        free_memory()
                        continue
                model = models[method]
                try:
                    row.update(train_at_plan(ctx, model, ckpt, seq, budget, ctx.s.steps3, ctx.s.target3,
                                             os.path.join(tmp, str(k))))
                except Exception as exc:  # a failed plan is a finding: record it, go on
                    row["error"] = _error(exc)
                    free_memory()
                finally:
                    set_checkpointing(model, False)
                durations.append(time.monotonic() - started)
                rows.append(row)
                print(f"  [3] {name} s{seq} {row['budget']}: " + (row.get("error") or (
                    f"{row['plan'].get('describe')}, {row['steps']} steps, OOMs {row['oom_warnings']}, peak "
                    f"{_mib(row['peak_bytes'])} / budget {_mib(row['budget_bytes'])}")), flush=True)
    finally:
        for model in models.values():
            release(model)
        models.clear()
        free_memory()
    done = [r for r in rows if "steps" in r]
    ooms = sum(r["oom_warnings"] + (r["allocator_ooms"] or 0) for r in done)
    over = [r["peak_over_budget"] for r in done if r.get("peak_over_budget") is not None]
    goals = [goal("OOMs seen while training at the plans", ooms, "0", ooms == 0 if done else None),
             goal("peak / budget (worst)", max(over) if over else None, "<= 1", max(over) <= 1 if over else None),
             goal("plans that failed to train", sum("error" in r for r in rows), "0",
                  not any("error" in r for r in rows) if rows else None)]
    return {"figures": {"rows": rows, "not_run": not_run, "skipped": skipped}, "goals": goals,
            "partial": bool(not_run)}


# --- section 4: a real OOM mid-run ----------------------------------------------------------------------------------
def memory_between(result, micro: int, smaller: int) -> float:
    """Memory (charged bytes) halfway between a step of ``smaller`` rows and one of ``micro`` rows, from the probe:
    its fitted line, or, with one measured size, a step's growth above what it starts with, proportional to rows."""
    if result.fitted is not None:
        a, b = result.fitted
        return a + b * (micro + smaller) / 2
    trial = max((t for t in result.trials if t.fits and t.peak_bytes), key=lambda t: t.micro_batch_size)
    top, base = trial.reserved_bytes or trial.peak_bytes, trial.baseline_bytes or 0
    return base + (top - base) * (micro + smaller) / 2 / trial.micro_batch_size


class Grab:
    """Before the window of step ``at``, takes device memory so the plan's micro-batch no longer fits but the next
    smaller one does (from the probe's memory line); keeps it to the end, as another process would. On CPU a real
    OOM kills the process, so there the next training forward raises torch.OutOfMemoryError instead."""

    def __new__(cls, ctx: Ctx, trainer, at: int):
        from transformers import TrainerCallback

        class _Grab(TrainerCallback):
            def __init__(self):
                self.held = None
                self.grabbed_bytes = 0
                self.armed = False
                self.fired = 0
                self.kind = "real (torch.empty holding device memory)" if ctx.cuda else (
                    "injected torch.OutOfMemoryError (CPU: a real OOM would kill the process)")
                self.hook = trainer.model.register_forward_pre_hook(self._raise)

            def _raise(self, module, args):
                if self.armed and module.training:
                    self.armed = False
                    self.fired += 1
                    raise torch.OutOfMemoryError("CPU out of memory (injected by bench_gpu section 4)")

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step != at or self.held is not None or self.armed:
                    return
                if not ctx.cuda:
                    self.armed = True
                    return
                facts = plan_facts(trainer.plan)
                m = int(facts["rows_per_forward_effective"])
                target = int(facts["target_batch_size"]) // int(facts["world_size"])
                smaller = max([d for d in divisors(target) if d < m] or [1])
                mid = memory_between(trainer.probe_result, m, smaller)
                free, _ = torch.cuda.mem_get_info(ctx.device)
                want = max(0, int(free + torch.cuda.memory_reserved(ctx.device) - mid))
                while want > 0 and self.held is None:  # what the allocator can hand out may be a little less
                    try:
                        self.held = torch.empty(want, dtype=torch.uint8, device=ctx.device)
                        self.grabbed_bytes = want
                    except torch.OutOfMemoryError:
                        want = int(want * 0.97) - 64 * MiB

            def on_train_end(self, args, state, control, **kwargs):
                self.held = None
                self.hook.remove()

        return _Grab()


def section_oom(ctx: Ctx) -> dict[str, Any]:
    from transformers import TrainerCallback

    s = ctx.s
    seq = min(ctx.s.seqs)
    model = ctx.llama()
    collator = PadCollator()
    rows = lm_rows([seq] * (s.steps4 * s.target4), s.model["vocab_size"], seed=4)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu4_") as tmp:
            budget = ("fraction", 0.9) if ctx.cuda else ("x_peak1", 12.0)
            kw = budget_kwargs(ctx, budget, lambda: peak_at_one(ctx, model, seq))
            trainer = make_trainer(ctx, model, rows, tmp, collator=collator, target_batch_size=s.target4,
                                   max_steps=s.steps4, **kw)
            before = plan_facts(trainer.tune())
            grab = Grab(ctx, trainer, at=2)
            trainer.add_callback(grab)
            # the probe and the checks before it collate rows too: count only what the training loop loads
            trainer.add_callback(type("CountFromHere", (TrainerCallback,), {
                "on_train_begin": lambda self, args, state, control, **kw: collator.seen.clear()})())
            ooms_before = ctx.num_ooms()
            with oom_log() as log:
                trainer.train()
            after = plan_facts(trainer.plan)
            seen = collator.seen
            figures = {
                "seq_len": seq, "oom_kind": grab.kind, "grabbed_bytes": grab.grabbed_bytes if ctx.cuda else None,
                "plan_before": before, "plan_after": after, "oom_warnings": log.messages,
                "allocator_ooms": None if ooms_before is None else ctx.num_ooms() - ooms_before,
                "steps": trainer.state.global_step, "max_steps": s.steps4, "samples_loaded": len(seen),
                "distinct_samples": len(set(seen)), "expected_samples": s.steps4 * s.target4,
            }
            release(trainer, grab)
    finally:
        release(model)
    recovered = (figures["steps"] == s.steps4 and after.get("effective_batch") == before.get("effective_batch")
                 == s.target4 and figures["samples_loaded"] == figures["distinct_samples"] == s.steps4 * s.target4)
    smaller = (after.get("rows_per_forward_effective") or 0) < (before.get("rows_per_forward_effective") or 0)
    goals = [goal("an OOM happened mid-run", len(figures["oom_warnings"]), ">= 1", len(figures["oom_warnings"]) >= 1),
             goal("recovered: all steps, same effective batch, every sample once", recovered, "true", recovered),
             goal("micro-batch lowered after the OOM", f"{before.get('rows_per_forward_effective')} -> "
                  f"{after.get('rows_per_forward_effective')}", "smaller", smaller)]
    return {"figures": figures, "goals": goals}


# --- section 5: throughput ------------------------------------------------------------------------------------------
def timed_run(ctx: Ctx, model, rows, out: str, *, accum_trainer: bool = True, **kwargs) -> tuple[float | None, Any]:
    timer = StepTimes(ctx)
    trainer = make_trainer(ctx, model, rows, out, accum_trainer=accum_trainer, callbacks=[timer],
                           max_steps=ctx.s.warm5 + ctx.s.timed5, **kwargs)
    try:
        trainer.train()
        plan = getattr(trainer, "plan", None)
        return timer.steady(skip=ctx.s.warm5), plan
    finally:
        release(trainer)
        model.zero_grad(set_to_none=True)


def section_throughput(ctx: Ctx) -> dict[str, Any]:
    s = ctx.s
    seq, target = s.seq5, s.target5
    model = ctx.llama()
    rows = lm_rows([seq] * ((s.warm5 + s.timed5) * target), s.model["vocab_size"], seed=5)
    tokens_per_step = seq * target
    per_token = flops.training_flops_per_token(model, seq)
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    peak = flops.bf16_peak_flops(device_name) if ctx.cuda else None
    figures: dict[str, Any] = {"config": "full, AdamW, no checkpointing", "seq_len": seq, "target": target,
                               "flops_per_token": per_token, "device": device_name, "bf16_peak_flops": peak}
    if peak is None:
        figures["mfu_null_reason"] = ("CPU run (--quick): no bf16 tensor-core peak" if not ctx.cuda
                                      else f"no bf16 peak in hf_accum.probing.flops.BF16_PEAK_TFLOPS for {device_name!r}")
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu5_") as tmp:
            budget = ("fraction", 0.9) if ctx.cuda else ("x_peak1", 6.0)
            kw = budget_kwargs(ctx, budget, lambda: peak_at_one(ctx, model, seq))
            secs, plan = timed_run(ctx, model, rows, os.path.join(tmp, "plan"), target_batch_size=target, **kw)
            facts = plan_facts(plan)
            chosen = int(facts["rows_per_forward_effective"])
            figures["plan"] = facts
            by_micro: dict[int, float] = {}
            figures["plan_seconds_per_step"] = secs
            figures["plan_tokens_per_second"] = tokens_per_step / secs if secs else None
            # the sweep of divisors: micro 1 and the plan's neighbours first, the rest while time is left
            order = [1, *sorted((d for d in divisors(target) if 1 < d <= chosen), key=lambda d: -d)]
            if s.sweep5 is not None:
                order = order[:s.sweep5]
            for micro in order:
                if ctx.clock.out(need=10.0 if ctx.cuda else 0.0):
                    figures["sweep_cut_short"] = True
                    break
                t, _ = timed_run(ctx, model, rows, os.path.join(tmp, f"m{micro}"), target_batch_size=target,
                                 per_device_train_batch_size=micro, gradient_accumulation_steps=target // micro,
                                 auto_tune=False)
                if t:
                    by_micro[micro] = tokens_per_step / t
            figures["tokens_per_second_by_micro"] = by_micro
            timed = dict(by_micro)
            if figures["plan_tokens_per_second"] and chosen not in timed:
                timed[chosen] = figures["plan_tokens_per_second"]  # the plan's own run is a point of the sweep
            best = max(timed.items(), key=lambda kv: kv[1]) if timed else (None, None)
            figures["sweep_best"] = {"micro": best[0], "tokens_per_second": best[1]}
            plan_tps = figures["plan_tokens_per_second"]
            figures["plan_over_best"] = plan_tps / best[1] if plan_tps and best[1] else None
            figures["plan_over_micro1"] = plan_tps / by_micro[1] if plan_tps and by_micro.get(1) else None
            figures["mfu_plan"] = flops.mfu(plan_tps or 0.0, per_token, peak)
            figures["mfu_best"] = flops.mfu(best[1] or 0.0, per_token, peak)
            # AccumTrainer / Trainer at the same micro x accumulation, interleaved; the fused loss off so both
            # compute the same thing (the overhead measured is the window engine's)
            micro = max(d for d in divisors(target) if d <= chosen)
            ratios, pairs = [], []
            for r in range(s.rounds5):
                if ctx.clock.out(need=5.0 if ctx.cuda else 0.0) and ratios:
                    figures["overhead_cut_short"] = True
                    break
                times = {}
                for cls in (("plain", "accum") if r % 2 == 0 else ("accum", "plain")):
                    extra = {"fused_loss": False, "target_batch_size": target} if cls == "accum" else {}
                    times[cls], _ = timed_run(ctx, model, rows, os.path.join(tmp, f"o{r}{cls}"),
                                              accum_trainer=cls == "accum", per_device_train_batch_size=micro,
                                              gradient_accumulation_steps=target // micro, **extra,
                                              **({"auto_tune": False} if cls == "accum" else {}))
                if times["plain"] and times["accum"]:
                    ratios.append(times["accum"] / times["plain"])
                    pairs.append(times)
            figures["overhead"] = {"micro": micro, "accumulation": target // micro, "rounds": pairs,
                                   "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None}
    finally:
        release(model)
    ratio = figures["overhead"]["median_ratio"] if "overhead" in figures else None
    goals = [goal("AccumTrainer / Trainer step time (median of interleaved rounds)", ratio, "<= 1.01",
                  ratio <= 1.01 if ratio is not None else None),
             goal("plan tokens/s over the sweep's best", figures.get("plan_over_best"), "info", None),
             goal("plan tokens/s over micro 1", figures.get("plan_over_micro1"), "info", None),
             goal("MFU at the plan", figures.get("mfu_plan"), "info", None)]
    return {"figures": figures, "goals": goals}


# --- section 6: token budgets and the fused loss -----------------------------------------------------------------
class ForwardCount:
    """Training forwards of a model and the token positions they held."""

    def __init__(self, model) -> None:
        self.forwards = self.tokens = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if module.training:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.forwards += 1
            self.tokens += int(ids.numel()) if torch.is_tensor(ids) else 0

    def remove(self) -> None:
        self.handle.remove()


def fused_step(ctx: Ctx, model, seq: int, micro: int, on: bool) -> dict[str, Any]:
    """One training step's charged peak and its median time (3 unprofiled runs), the fused loss on or off."""
    from hf_accum.levers.kernels import fused_loss as fl

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = make_step_fn(model, opt, random_token_batch(model, seq))
    meter = ctx.meter(model, opt)
    with fl.fused_lm_loss(model) if on else contextlib.nullcontext():
        try:
            step(micro)
            m = meter.measure(lambda: step(micro))
            secs = statistics.median(meter.time(lambda: step(micro)) for _ in range(3))
            return {"peak_bytes": m.charged_bytes, "seconds_per_step": secs}
        except Exception as exc:
            if not is_oom(exc):
                raise
            return {"out_of_memory": True}
        finally:
            opt.state.clear()
            model.zero_grad(set_to_none=True)
            free_memory()


def section_tokens(ctx: Ctx) -> dict[str, Any]:
    from hf_accum.levers.kernels import fused_loss as fl

    s = ctx.s
    seq, target, steps = s.seq6, s.target6, s.steps6
    lengths = long_tailed_lengths(steps * target, seq, seed=6, every_longest=32)
    rows = lm_rows(lengths, s.model["vocab_size"], seed=6)
    model = ctx.llama()
    figures: dict[str, Any] = {"seq_len": seq, "target": target, "steps": steps, "real_tokens": sum(lengths),
                               "lengths": {"median": statistics.median(lengths), "longest": max(lengths)}}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu6_") as tmp:
            budget = ("fraction", 0.9) if ctx.cuda else ("x_peak1", 4.0)
            kw = budget_kwargs(ctx, budget, lambda: peak_at_one(ctx, model, seq))
            modes, durations = {}, []
            for mode in ("samples", "tokens"):
                started = time.monotonic()
                if ctx.clock.out(typical(durations)) and modes:
                    figures["modes_cut_short"] = True
                    break
                timer = StepTimes(ctx)
                # both modes at one checkpointing level (none): the lever chooses per mode, by measured time, and a
                # different level in each would confound the padding and time this section compares
                trainer = make_trainer(ctx, model, rows, os.path.join(tmp, mode), callbacks=[timer],
                                       target_batch_size=target, max_steps=steps, micro_batching=mode,
                                       gradient_checkpointing=False, **kw)
                try:
                    start = time.perf_counter()
                    plan = trainer.tune()
                    probe_s = time.perf_counter() - start
                    count = ForwardCount(model)
                    ctx.reset_peak()
                    with oom_log() as log:
                        if ctx.cuda:
                            trainer.train()
                            peak = ctx.peak_reserved()
                        else:
                            peak = CpuMeter(resident=lambda: live_tensor_bytes(model)).measure(trainer.train).peak_bytes
                    count.remove()
                    budget_bytes = trainer.probe_result.budget_bytes if trainer.probe_result else None
                    modes[mode] = {
                        "plan": plan_facts(plan), "probe_seconds": probe_s, "probe_trials":
                        len(trainer.probe_result.measured_trials) if trainer.probe_result else None,
                        "forwards_per_step": count.forwards / max(1, trainer.state.global_step),
                        "padded_over_real_tokens": count.tokens / figures["real_tokens"],
                        "seconds_per_step": timer.steady(skip=1), "peak_bytes": peak, "budget_bytes": budget_bytes,
                        "peak_over_budget": peak / budget_bytes if peak and budget_bytes else None,
                        "oom_warnings": len(log.messages),
                    }
                finally:
                    release(trainer)
                    model.zero_grad(set_to_none=True)
                    durations.append(time.monotonic() - started)
            figures["modes"] = modes
            # the fused loss on vs off at one micro-batch: a step's peak and its time
            micro = s.micro6
            fused: dict[str, Any] = {"micro": micro, "seq_len": seq, "vocab": s.model["vocab_size"],
                                     "implementation": fl._describe_implementation()}
            for on in (False, True):
                if ctx.clock.out() and len(fused) > 4:
                    fused["cut_short"] = True
                    break
                fused["on" if on else "off"] = fused_step(ctx, model, seq, micro, on)
            on, off = fused.get("on", {}), fused.get("off", {})
            if on.get("peak_bytes") and off.get("peak_bytes"):
                fused["peak_ratio"] = on["peak_bytes"] / off["peak_bytes"]
                fused["time_ratio"] = on["seconds_per_step"] / off["seconds_per_step"]
            figures["fused_loss"] = fused
    finally:
        release(model)
    modes = figures.get("modes", {})
    worst = [m["peak_over_budget"] for m in modes.values() if m.get("peak_over_budget") is not None]
    both = "tokens" in modes and "samples" in modes
    fewer = modes["tokens"]["forwards_per_step"] / modes["samples"]["forwards_per_step"] if both else None
    padding = (modes["tokens"]["padded_over_real_tokens"] / modes["samples"]["padded_over_real_tokens"]
               if both else None)
    ratio = figures.get("fused_loss", {}).get("peak_ratio")
    goals = [goal("peak / budget in both modes (worst)", max(worst) if worst else None, "<= 1",
                  max(worst) <= 1 if worst else None),
             goal("tokens-mode padded tokens over samples-mode", padding, "<= 1", padding <= 1 if padding else None),
             goal("tokens-mode forwards per step over samples-mode", fewer, "info", None),
             goal("fused-loss peak over unfused at equal micro", ratio, "< 1", ratio < 1 if ratio else None)]
    return {"figures": figures, "goals": goals}


# --- section 7: the estimate beside the measurement ------------------------------------------------------------
def estimate_builder(ctx: Ctx, method: str):
    """The section's model as `Ctx.method_model` builds it, for the estimate to build on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        model = LlamaForCausalLM(LlamaConfig(**ctx.s.model)).to(ctx.dtype)
        if method == "full":
            return model
        from peft import LoraConfig

        from hf_accum.probing.loading import add_lora

        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_MODULES, task_type="CAUSAL_LM")
        return add_lora(model, lora, checkpointing=True)

    return build


def measured_peaks(ctx: Ctx, method: str, seq: int, sizes: tuple[int, ...]) -> dict[int, tuple[int, int | None]]:
    """(peak allocated, peak reserved) of one real step at each size, after a warm-up step (None: out of memory)."""
    model = ctx.method_model(method)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    step = make_step_fn(model, opt, random_token_batch(model, seq))
    out: dict[int, tuple[int, int | None]] = {}
    try:
        step(1)
        for micro in sizes:
            try:
                m = ctx.meter(model, opt).measure(lambda micro=micro: step(micro))
            except torch.OutOfMemoryError:
                break
            out[micro] = (m.peak_bytes, m.reserved_bytes)
    finally:
        opt.state.clear()
        release(model, opt)
    return out


def section_estimate(ctx: Ctx) -> dict[str, Any]:
    """`hf-accum probe --estimate` (fake tensors, nothing allocated) against the meter at the same sizes: CUDA's
    peak reserved and allocated on a GPU, the CPU meter's peak under --quick (there the estimate is for "cpu")."""
    from hf_accum.probing.estimate import estimate_peaks

    sizes = (1, 2) if ctx.quick else (1, 2, 4)
    device = "cuda" if ctx.cuda else "cpu"
    rows, worst = [], []
    for method in ("lora", "full"):
        for seq in ctx.s.seqs:
            if ctx.clock.out():
                break
            start = time.perf_counter()
            predicted = estimate_peaks(estimate_builder(ctx, method), sizes, seq_len=seq, device=device)
            seconds = time.perf_counter() - start
            for micro, (allocated, reserved) in measured_peaks(ctx, method, seq, sizes).items():
                charged = reserved if reserved is not None else allocated
                error = predicted[micro] / charged - 1
                worst.append(abs(error))
                rows.append({"method": method, "seq": seq, "micro": micro, "estimate_bytes": predicted[micro],
                             "max_allocated_bytes": allocated, "max_reserved_bytes": reserved,
                             "error_vs_reserved" if reserved is not None else "error_vs_peak": error,
                             "estimate_seconds": seconds})
                print(f"  {method} seq {seq} micro {micro}: estimate {_mib(predicted[micro])}, allocated "
                      f"{_mib(allocated)}, reserved {_mib(reserved)}, error {error:+.1%}", flush=True)
    figures = {"rows": rows, "device_estimated": device}
    against = "reserved" if ctx.cuda else "CPU meter's peak"
    bound = 0.10 if ctx.cuda else 0.05
    value = max(worst) if worst else None
    goals = [goal(f"worst |estimate / {against} - 1|", value, f"<= {bound:.0%}",
                  value <= bound if value is not None else None)]
    return {"figures": figures, "goals": goals}


# --- section 8: the per-layer levers, swept -----------------------------------------------------------------------
def lever_levels(ctx: Ctx, num_layers: int) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """(kind, k) for none and each lever at k in {L/2, L}; levers this device lacks, with the reason."""
    from hf_accum.levers import activation_offload as offload

    ks = sorted({max(1, num_layers // 2), num_layers})
    kinds = ["full", "selective", "offload"]
    skipped = {}
    why = offload.why_unavailable(ctx.device)
    if why is not None:
        kinds.remove("offload")
        skipped["offload"] = why
    return [("none", 0)] + [(kind, k) for kind in kinds for k in ks], skipped


def lever_context(model, kind: str, k: int, num_layers: int):
    """The model with ``k`` decoder layers at one level (the first k; the mechanics directly, no registry)."""
    from hf_accum.compat import gradient_checkpointing
    from hf_accum.levers import activation_offload as offload
    from hf_accum.levers import selective

    if kind == "plan":  # the tuner's choice: k = (full, selective) layers, the first full, the next selective
        return selective.layer_levels(model, k[0], k[1], {"use_reentrant": False})
    if kind == "none" or k == 0:
        return contextlib.nullcontext()
    if kind == "full":
        return gradient_checkpointing.checkpointed_layers(model, k, {"use_reentrant": False})
    if kind == "selective":
        return selective.layer_levels(model, 0, k, {"use_reentrant": False})
    return offload.offloaded_layers(model, offload.layout(num_layers, 0, 0, k))


def training_loss(model):
    """(context, how): the loss AccumTrainer trains with, so the sweep measures what the tuner plans for: the fused
    LM loss where supported (the trainer's default: the logits never materialize), else the model's own."""
    from hf_accum.levers.kernels import fused_loss as fl

    why = fl.unsupported_reason(model)
    return (fl.fused_lm_loss(model), "fused LM loss") if why is None else (contextlib.nullcontext(), why)


def lever_point(ctx: Ctx, model, opt, step, level: tuple[str, int], micro: int, seq: int) -> dict[str, Any]:
    """One grid point: the peak of a step (allocated, reserved on CUDA) and the fastest of 3 timed steps; an
    out-of-memory step is recorded as "OOM" and its memory given back."""
    kind, k = level
    row: dict[str, Any] = {"level": kind, "layers": k, "micro": micro}
    meter = ctx.meter(model, opt)
    oom = False
    with lever_context(model, kind, k, len(_decoder_layers(model))):
        try:
            m = meter.measure(lambda: step(micro))
            seconds = min(meter.time(lambda: step(micro)) for _ in range(3))
        except Exception as exc:
            if not is_oom(exc):
                raise
            oom = True
    if oom:
        model.zero_grad(set_to_none=False)
        free_memory()
        return {**row, "result": "OOM"}
    return {**row, "result": "ok", "step_seconds": seconds, "tokens_per_second": micro * seq / seconds,
            "peak_allocated_bytes": m.peak_bytes, "peak_reserved_bytes": m.reserved_bytes,
            "charged_bytes": m.charged_bytes}


def _decoder_layers(model) -> list:
    from hf_accum.compat import gradient_checkpointing

    return gradient_checkpointing.checkpointable_layers(model)


def lever_sweep(ctx: Ctx, model, seq: int, levels: list[tuple[str, int]], end: float) -> tuple[list, list]:
    """Every micro-batch x level, smallest micro-batches first (so a cut keeps every level's small sizes); a level
    that ran out of memory at m is not run above m. (rows, points not run with the reason)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = make_step_fn(model, opt, random_token_batch(model, seq))
    rows, not_run, durations = [], [], []
    oom_at: dict[tuple[str, int], int] = {}
    loss, _ = training_loss(model)
    try:
        loss.__enter__()
        step(1)  # AdamW's state and the kernels, before the first measured point
        for micro in ctx.s.micros8:
            for level in levels:
                point = {"level": level[0], "layers": level[1], "micro": micro}
                if level in oom_at:
                    not_run.append({**point, "reason": f"OOM at micro {oom_at[level]}"})
                elif time.monotonic() + typical(durations) >= end or ctx.clock.out(typical(durations)):
                    not_run.append({**point, "reason": "time limit"})
                else:
                    started = time.monotonic()
                    row = lever_point(ctx, model, opt, step, level, micro, seq)
                    durations.append(time.monotonic() - started)
                    rows.append(row)
                    oom_at.update({level: micro} if row["result"] == "OOM" else {})
                    print(f"  {_lever_line(row)}", flush=True)
    finally:
        loss.__exit__(None, None, None)
        opt.state.clear()
        model.zero_grad(set_to_none=True)
        del opt
        free_memory()
    return rows, not_run


def _lever_line(row: dict) -> str:
    head = f"{row['level']:>9} k={row['layers']:<2} micro {row['micro']:<3}"
    if row["result"] != "ok":
        return f"{head} {row['result']}"
    return (f"{head} {row['step_seconds']:.3f} s/step, {row['tokens_per_second']:.0f} tokens/s, peak "
            f"{_mib(row['peak_allocated_bytes'])} allocated, {_mib(row['peak_reserved_bytes'])} reserved")


def tuner_budget(rows: list[dict], num_layers: int) -> tuple[int | None, str | None]:
    """Halfway between micro 1's charged peak without checkpointing and with half the layers checkpointed: no
    checkpointing does not fit, a partly checkpointed level does. (None, why) when the sweep lacks either point."""
    def charged(kind: str, k: int) -> int | None:
        found = [r for r in rows if (r["level"], r["layers"], r["micro"]) == (kind, k, 1) and r["result"] == "ok"]
        return found[0]["charged_bytes"] if found else None

    none, half = charged("none", 0), charged("full", max(1, num_layers // 2))
    if none is None or half is None or half >= none:
        return None, f"micro 1 not measured (or no lower) without and with half the layers checkpointed: {none}, {half}"
    return (none + half) // 2, None


def tuner_choice(ctx: Ctx, model, seq: int, budget: int) -> dict[str, Any]:
    """AccumTrainer's tuner (checkpoint_layers='auto') under ``budget``: its plan, probe seconds, and its point
    measured like the sweep's."""
    target = ctx.s.target8
    rows = lm_rows([seq] * (2 * target), ctx.s.model["vocab_size"], seed=8)
    with tempfile.TemporaryDirectory(prefix="bench_gpu8_") as tmp:
        trainer = make_trainer(ctx, model, rows, tmp, target_batch_size=target, max_steps=1,
                               checkpoint_layers="auto", memory_budget_bytes=budget)
        try:
            start = time.perf_counter()
            plan = trainer.tune()
            out = {"budget_bytes": budget, "target": target, "plan": plan_facts(plan),
                   "probe_seconds": time.perf_counter() - start}
        finally:
            release(trainer)
            model.zero_grad(set_to_none=True)
    facts = out["plan"]
    micro, levers = facts.get("rows_per_forward_effective"), facts.get("levers") or {}
    record = levers.get("selective") or {}  # the searched lever's record (selective contains checkpointing's levels)
    k = (record.get("full", (levers.get("checkpointing") or {}).get("layers", 0)), record.get("selective", 0))
    if micro and not ctx.clock.out():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        step = make_step_fn(model, opt, random_token_batch(model, seq))
        try:
            with training_loss(model)[0]:
                step(1)
                out["measured"] = lever_point(ctx, model, opt, step, ("plan", k), int(micro), seq)
                out["measured"]["layers"] = f"{k[0]}f+{k[1]}s"  # full + selective, as printed
        finally:
            opt.state.clear()
            release(opt)
    return out


def section_levers(ctx: Ctx) -> dict[str, Any]:
    """Micro-batch x per-layer level (none / full / selective checkpointing / offload of k layers) on the section's
    Llama at seq8: step time (fastest of 3) and peak memory per point; then the tuner's choice under a budget only
    partly checkpointed levels fit. Capped at cap8 seconds, whatever --minutes leaves."""
    seq = ctx.s.seq8
    limit = min(ctx.s.cap8, max(0.0, ctx.clock.left()))
    end, sweep_end = time.monotonic() + limit, time.monotonic() + 0.75 * limit  # the rest for the tuner
    model = ctx.llama()
    num_layers = len(_decoder_layers(model))
    levels, skipped = lever_levels(ctx, num_layers)
    figures: dict[str, Any] = {"seq_len": seq, "micros": list(ctx.s.micros8), "num_layers": num_layers,
                               "levels": [f"{kind} {k}" for kind, k in levels], "skipped": skipped,
                               "cap_seconds": ctx.s.cap8, "loss": training_loss(model)[1]}
    for why in skipped.values():
        print(f"  {why}", flush=True)
    try:
        rows, not_run = lever_sweep(ctx, model, seq, levels, sweep_end)
        figures.update(rows=rows, not_run=not_run)
        budget, why = tuner_budget(rows, num_layers)
        if budget is None or time.monotonic() >= end:
            figures["tuner"] = {"skipped": why or "time limit"}
        else:
            figures["tuner"] = tuner_choice(ctx, model, seq, budget)
    finally:
        release(model)
    return {"figures": figures, "goals": lever_goals(figures), "partial": bool(not_run_for_time(figures))}


def not_run_for_time(figures: dict) -> list:
    return [p for p in figures.get("not_run", []) if p["reason"] == "time limit"]


def window_seconds(row: dict, target: int) -> float:
    """One optimizer step of ``target`` samples at a sweep point: ceil(target / micro) forwards of its step time."""
    return math.ceil(target / row["micro"]) * row["step_seconds"]


def lever_goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    ok = [r for r in figures.get("rows", []) if r["result"] == "ok"]
    best = min(ok, key=lambda r: r["step_seconds"] / r["micro"], default=None)
    tuner = figures.get("tuner", {})
    plan, measured = tuner.get("plan", {}), tuner.get("measured", {})
    fits = ratio = None
    if measured.get("result") == "ok":
        fits = measured["charged_bytes"] <= tuner["budget_bytes"]
        # the tuner chooses among none / selective / full checkpointing per layer (hf_accum/levers/selective.py): the
        # sweep's best of those within the budget
        within = [r for r in ok if r["level"] in ("none", "full", "selective")
                  and r["charged_bytes"] <= tuner["budget_bytes"]]
        if within:
            sweep_best = min(window_seconds(r, tuner["target"]) for r in within)
            ratio = window_seconds(measured, tuner["target"]) / sweep_best
            tuner["sweep_best_window_seconds"] = sweep_best
    return [goal("grid points measured (OOM points included)", len(figures.get("rows", [])), "info", None),
            goal("fastest point per sample", f"{best['level']} k={best['layers']} micro {best['micro']}"
                 if best else None, "info", None),
            goal("tuner's choice (micro, lever levels)",
                 f"{plan.get('rows_per_forward_effective')}, {plan.get('levers')}" if plan else None,
                 "info", None),
            goal("tuner's choice measured within its budget", fits, "True", fits),
            goal("tuner's optimizer step over the sweep's best within the budget (none/selective/full points)", ratio,
                 "<= 1.05", ratio <= 1.05 if ratio is not None else None)]


def section_loss_kernels(ctx: Ctx) -> dict[str, Any]:
    """benchmarks/bench_loss_kernels.py on this device: every loss kernel that runs here x chunk sizes (CUDA: micro
    4 x seq 2048, vocab 128256, bf16; --quick: its CPU shape, smaller), peak and time relative to the unfused loss,
    and the tuner's pick against the sweep's fastest. Liger and Cut Cross-Entropy fill their rows where installed."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling script
    import bench_loss_kernels

    device = "cuda" if ctx.cuda else "cpu"
    shape = None if ctx.cuda or not ctx.quick else {"seq": 128, "hidden": 64, "vocab": 4096, "rows": (64, 256)}
    out = bench_loss_kernels.run(device, repeats=2 if ctx.quick else 3, shape=shape)
    print(bench_loss_kernels.table(out), flush=True)
    ratio = out["pick_vs_fastest"]
    return {"figures": out, "goals": [goal("tuner's loss kernel over the sweep's fastest (one loss step)", ratio,
                                           "<= 1.05", ratio <= 1.05)]}


SECTIONS: dict[int, Callable[[Ctx], dict[str, Any]]] = {
    1: section_model, 2: section_probe, 3: section_train, 4: section_oom, 5: section_throughput, 6: section_tokens,
    7: section_estimate, 8: section_levers, 9: section_loss_kernels,
}


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


def _mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.0f} MiB"


# --- the run ------------------------------------------------------------------------------------------------------
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
