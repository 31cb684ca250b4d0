"""The run's settings, clock and context (`Ctx`), and small helpers every section uses."""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from hf_accum.probing.meters import CpuMeter, CudaMeter, Meter, live_tensor_bytes
from hf_accum.window.oom import free_memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
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


def _mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.0f} MiB"


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
