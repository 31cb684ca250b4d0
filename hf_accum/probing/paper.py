"""The model on paper: `estimate` (the public function) and `hf-accum probe --estimate` (the probe's flags, the model
from its config alone, the probe's report). The search itself is the probe's (`estimate.estimate_model`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

from .estimate import CUDA_ASSUMPTIONS, Estimate, estimate_model

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from "80GiB", "80 GB", "1.5TiB" or a plain integer; ValueError naming the forms otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--device-memory={text!r}: give a positive size such as 80GiB, 24GB or 17179869184")
    size = int(float(m.group(1)) * _UNITS[unit])
    if not unit and size < 2**20:  # "80": a card's GiB with the unit left out, not 80 bytes
        raise ValueError(f"--device-memory={text!r} has no unit and reads as {size} bytes: did you mean "
                         f"{m.group(1)}GiB? Give the unit (80GiB, 24GB), or bytes of at least 1 MiB")
    return size


def load_config(name: str):
    """The config of ``name`` (a folder with config.json, a hub id, or "tiny", the built-in model), or one ValueError
    line as the probe gives."""
    from transformers import AutoConfig

    from .loading import hub_unreachable, not_loadable

    if name == "tiny":  # the built-in offline model, built from a config in code (as `hf-accum probe` loads it)
        from .. import tiny

        return tiny.build_config()
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise ValueError(f"--model {name}: the folder holds no config.json; give a folder saved with save_pretrained "
                         "or a hub id")
    unreachable = hub_unreachable("--model", name)
    if unreachable is not None:
        raise unreachable
    try:
        return AutoConfig.from_pretrained(name)
    except OSError as exc:  # a missing path or a hub id not in the cache: one line, as the probe without --estimate
        raise not_loadable("--model", name, exc) from None


def config_builder(config, task: str = "causal_lm"):
    """A callable building the model of ``config`` from the config alone (no weights): its causal-LM head, or with
    ``task="classification"`` its sequence-classification head (``config.num_labels`` classes)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    return lambda: auto.from_config(config)


def weights_dtype(config) -> str:
    """The dtype the config builds the weights in (``dtype`` / ``torch_dtype``; float32 when it names none): the
    estimate keeps it, and --bf16 is autocast only, so an 8B config without one estimates float32 weights."""
    # `torch_dtype` is the old name (a FutureWarning on read where `dtype` exists): read only where `dtype` is absent
    named = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    return str(named).removeprefix("torch.") if named is not None else "float32 (the config names no dtype)"


def with_fused_loss(build, setting: bool | None):
    """``build`` with the fused loss installed as the probe installs it (``--fused-loss``: required; unset: where
    the head and the config allow it; ``--no-fused-loss``: off). The estimate then runs the loss kernel's memory
    model (estimate.py says which kernel it assumed)."""
    if setting is False:
        return build

    def built():
        from ..levers.kernels.fused_loss import patch_model, unsupported_reason

        model = build()
        why = unsupported_reason(model, verify=False)
        if why is None:
            patch_model(model)
        elif setting:
            raise ValueError(f"--fused-loss, but {why}. Set --no-fused-loss to estimate with the full logits.")
        return model

    return built


def builder(model, lora_r: int | None, lora_target_modules: str | None, fused_loss: bool | None,
            task: str = "causal_lm"):
    """The model as the estimate builds it: ``model`` (a config folder or hub id: from its config; or a callable),
    LoRA adapters of rank ``lora_r`` (None: none), the fused loss as the trainer installs it (`with_fused_loss`)."""
    build = config_builder(load_config(model), task) if isinstance(model, str) else model
    if lora_r is not None:
        build = with_lora(build, lora_r, lora_target_modules, task)
    return with_fused_loss(build, fused_loss)


def with_lora(build, r: int, targets: str | None, task: str = "causal_lm"):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets.split(",") if targets else "all-linear",
                      lora_dropout=0.0, task_type="SEQ_CLS" if task == "classification" else "CAUSAL_LM")
    return lambda: _wrap(get_peft_model, build(), lora)


def _wrap(get_peft_model, model, lora):
    from ..compat.gradient_checkpointing import peft_reads_quietly

    with peft_reads_quietly():
        return get_peft_model(model, lora)


def machine_device() -> str:
    """The device an estimate is for when none is named: this machine's (cuda where torch sees a GPU)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def machine_memory(device: str, flag: str) -> int:
    """The memory of this machine's ``device`` (GPU 0's for cuda); a ValueError naming ``flag`` where it has none."""
    import torch

    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"an estimate for cuda on a machine without a GPU needs {flag}, the card's memory "
                             "(e.g. 80GiB)")
        return torch.cuda.get_device_properties(0).total_memory
    from .meters import CpuMeter

    return CpuMeter().capacity_bytes()


def refusal(args: Any) -> str | None:
    """The one line refusing what the estimate does not model, None when it can run (a recipe: `recipe_paper`)."""
    if args.recipe is not None:
        return None  # the bare model's flags are refused with a recipe; what a recipe sets: recipe_paper.settings
    if args.optimize != "memory":
        return "--estimate times nothing: drop --optimize throughput"
    return None


def cli_checkpoint_layers(args: Any) -> str | int | None:
    """``checkpoint_layers`` from --gradient-checkpointing ("all") / --checkpoint-layers (auto or K); None: neither."""
    from ..levers.checkpointing import parse_layers

    if args.gradient_checkpointing:
        return "all"
    if args.checkpoint_layers is None:
        return None
    return parse_layers(args.checkpoint_layers, "--checkpoint-layers")


def level_lines(est: Estimate) -> list[str]:
    """Each checkpointing level the estimate ran, its predicted peaks (one line per level); [] without checkpointing."""
    if est.checkpointed_layers is None or (len(est.level_peaks) == 1 and not est.checkpointed_layers):
        return []
    lines = []
    for k, peaks in est.level_peaks.items():
        chosen = " (the plan's)" if k == est.checkpointed_layers else ""
        lines.append(f"checkpointing {k} layers{chosen}: " + ", ".join(f"{m}: {v / 2**20:.1f} MiB"
                                                                       for m, v in peaks.items()))
    return lines


def say_assumed(est, say) -> None:
    """The lines saying what an estimate assumed (its loss, then the rest)."""
    say(f"assumed: {est.loss}")
    for line in est.assumptions:
        say(f"assumed: {line}")


def write_json(args: Any, est, say) -> int:
    """``--json FILE``: the estimate as JSON, and a line saying where. The command's exit status."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(est.to_json(), f, indent=2, default=str)
        say(f"wrote {args.json}")
    return 0


def run(args: Any, say=print) -> int:
    import torch

    from .estimate import estimate_model
    from .report import summary, table

    device = args.device or machine_device()
    memory = parse_size(args.device_memory) if args.device_memory else machine_memory(device, "--device-memory")
    config = load_config(args.model)
    lora = args.lora or args.load_in_4bit or args.load_in_8bit  # a quantized base trains LoRA, as the probe's
    build = builder(config_builder(config), args.lora_r if lora else None, args.lora_target_modules, args.fused_loss)
    base = (" (linear layers NF4, bitsandbytes' storage)" if args.load_in_4bit else
            " (linear layers int8, bitsandbytes' storage)" if args.load_in_8bit else "")
    say(f"estimating {args.model} for {device} with {memory / 2**30:.1f} GiB (fake tensors: nothing loaded; "
        f"weights {weights_dtype(config)}{base}) ...")
    quantization = "nf4" if args.load_in_4bit else "int8" if args.load_in_8bit else None
    est = estimate_model(build, seq_len=args.seq_len, target_batch_size=args.target_batch, device_memory=memory,
                         device=device, world_size=args.world_size, budget_bytes=args.budget_bytes,
                         budget_fraction=args.budget, bf16=args.bf16, max_micro_batch=args.max_micro_batch,
                         log=lambda msg: say(f"  {msg}"), quantization=quantization,
                         checkpoint_layers=cli_checkpoint_layers(args),
                         # the probe's --load-in-4bit: NF4 without double quantization, computing in the autocast dtype
                         quantization_options={"compute_dtype": torch.bfloat16 if args.bf16 else torch.float32,
                                               "double_quant": False})
    say("")
    say(table(est.result, args.seq_len))
    say("")
    source = ("--budget-bytes" if args.budget_bytes else "of --device-memory" if args.device_memory else
              f"of this machine's {device} memory")
    say(summary(est.result, est.plan, args.seq_len, source))
    say("predicted peak per micro-batch: " + ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in est.peaks.items()))
    for line in level_lines(est):
        say(line)
    say_assumed(est, say)
    return write_json(args, est, say)


def estimate(model: str | Callable[[], Any], *, seq_len: int, target_batch_size: int, device: str | None = None,
             device_memory: int | str | None = None, lora_r: int | None = None, lora_target_modules: str | None = None,
             fused_loss: bool | None = None, task: str = "causal_lm", gpus: int | list[int] | None = None,
             sharding: Any = None, **kwargs: Any):
    """The plan for ``model`` (a folder holding config.json, a hub id, or a callable building the model; nothing is
    loaded) on ``device`` (default: this machine's) with ``device_memory`` (bytes or "80GiB"; default: this
    machine's, and required for cuda on a machine without a GPU: no card size is assumed); ``lora_r``: train LoRA
    adapters of that rank. ``quantization`` ("nf4", "int8": bitsandbytes' storage and dequantization,
    `paper_quantized.py`) and ``pairs`` ("dpo", "reward": TRL's pair step, `paper_pairs.py`) pass to
    `estimate_model`. ``fused_loss``: as the trainer's (None: the fused loss where the model allows it, its
    kernel's memory model). ``task``: "causal_lm", or "classification" (the config's sequence-classification head,
    ``config.num_labels`` classes, one label per sample). Other keywords as `estimate_model` (world_size,
    budget_bytes, budget_fraction, bf16, max_micro_batch, log, checkpoint_layers: None, "auto", "all" or K).

    ``gpus`` (a count or a list of counts) or ``sharding`` ("fsdp2", "fsdp2-keep", "zero1".."zero3" with
    "+offload", or a DeepSpeed config dict): the sharded estimate instead, a `paper_sharded.ShardedEstimate` (its
    cells: per GPU count the largest micro-batch per rank and the plan; ``seq_len`` and ``device_memory`` may be
    lists; keywords bf16, budget_fraction, max_micro_batch, quantization, log)."""
    if gpus is not None or sharding is not None:
        return _sharded(model, seq_len, target_batch_size, device or "cuda", device_memory, lora_r,
                        lora_target_modules, fused_loss, gpus, sharding, kwargs)
    device = device or machine_device()
    if device_memory is None:
        device_memory = machine_memory(device, "device_memory")

    if kwargs.get("pairs") is not None and fused_loss:
        raise ValueError(f"fused_loss=True with pairs={kwargs['pairs']!r}: the pairs' step has its own loss (TRL's); "
                         "leave fused_loss unset")
    build = builder(model, lora_r, lora_target_modules, False if kwargs.get("pairs") is not None else fused_loss, task)
    memory = parse_size(device_memory) if isinstance(device_memory, str) else int(device_memory)
    return estimate_model(build, seq_len=seq_len, target_batch_size=target_batch_size, device_memory=memory,
                          device=device, task=task, **kwargs)


def _sharded(model, seq_len, target_batch_size, device, device_memory, lora_r, lora_target_modules, fused_loss,
             gpus, sharding, kwargs):
    from .paper_sharded import sharded_grid

    allowed = {"bf16", "budget_fraction", "max_micro_batch", "quantization", "quantization_options", "log"}
    extra = sorted(set(kwargs) - allowed)
    if extra:
        raise ValueError(f"{extra[0]}= is not modelled by the sharded estimate (gpus/sharding): give only "
                         f"{', '.join(sorted(allowed))}")
    if device_memory is None:
        raise ValueError("gpus/sharding: give device_memory, the card's memory (e.g. \"80GiB\" or a list)")
    cards = [parse_size(c) if isinstance(c, str) else int(c)
             for c in (device_memory if isinstance(device_memory, (list, tuple)) else [device_memory])]
    build = builder(model, lora_r, lora_target_modules, fused_loss)
    fraction = kwargs.get("budget_fraction")
    return sharded_grid(build, seq_lens=list(seq_len) if isinstance(seq_len, (list, tuple)) else [seq_len],
                        cards=cards, gpus=list(gpus) if isinstance(gpus, (list, tuple)) else [gpus or 1],
                        sharding=sharding or "fsdp2", target_batch_size=target_batch_size, device=device,
                        bf16=kwargs.get("bf16", False), fraction=0.9 if fraction is None else fraction,
                        max_micro_batch=kwargs.get("max_micro_batch"), quantization=kwargs.get("quantization"),
                        quantization_options=kwargs.get("quantization_options"), log=kwargs.get("log"))


__all__ = ["CUDA_ASSUMPTIONS", "Estimate", "estimate", "estimate_model"]
