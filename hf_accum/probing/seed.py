"""The real probe started from the estimate: `probe_with_estimate` runs the estimate on the model's own config
(fake tensors, the same settings, the device the run uses) and seeds the probe's micro-batch search with the
estimated largest fit, so a right estimate leaves two trials (the fit and the size above it). With the checkpointing
lever's level search (`levels.probe_levels`, ``checkpoint_layers="auto"``) the estimate runs the same level search on
paper and each anchor's search starts from the estimate's largest fit at that level.

The plan is always the measured one: the estimate only says where to look first (`MicroBatchSearch`'s ``seed``).
The paper model is the model as the trainer runs it: rebuilt from its config and LoRA config, its bitsandbytes
quantization (NF4 / int8, from ``config.quantization_config``) and TRL's fused LM head where the model carries it
(AccumSFTTrainer's loss), each weight in the dtype the trainer gave it.
When the estimate cannot be made (another quantization, a lever other than checkpointing, a model not built from its
config, ...) the probe searches as before, and says why in one log line. What the estimate predicted is kept in
``result.extra["estimate"]``, so the plan file records it beside what was measured.

An estimate is a function of what it is given: the rebuilt model (`builder_like`'s ``key``: its class, config, LoRA
config, parameters' names, shapes, dtypes and trainability, checkpointed layers, loss head and kernel) and the
search's settings. One made for the same key earlier in this process is not made again (`MADE`, the newest
`MADE_LIMIT`): a notebook that tunes twice, or a run per learning rate, pays for it once; the log line says so.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..compat import parallel
from .estimate import estimate_model
from .loop import NothingFitsError, ProbeResult
from .meters import Meter
from .probe import Seeder, probe_model
from .reserved import expandable_from_env

MADE_LIMIT = 32
MADE: OrderedDict[str, tuple[dict[str, Any], Any]] = OrderedDict()  # key -> (record, the estimate's level count)


def probe_with_estimate(model: torch.nn.Module, **kwargs: Any):
    """`probe.probe_model` (same keywords), its search seeded by the estimate of ``model`` (see the module
    docstring). ``kwargs["log"]`` says whether the estimate ran and what it predicted."""
    seeder = seeder_for(model, seq_len=kwargs["seq_len"], target_batch_size=kwargs["target_batch_size"],
                        world_size=kwargs.get("world_size", 1), autocast_dtype=kwargs.get("autocast_dtype"),
                        max_micro_batch=kwargs.get("max_micro_batch"), log=kwargs.get("log"),
                        lever=kwargs.get("lever"))
    return probe_model(model, seeder=seeder, **kwargs)


def seeder_for(model: torch.nn.Module, *, seq_len: int, target_batch_size: int, world_size: int = 1,
               autocast_dtype: torch.dtype | None = None, max_micro_batch: int | None = None,
               log: Callable[[str], None] | None = None, lever: Any = None) -> Seeder:
    """The ``seeder`` of `probe.probe_model`: the estimate of ``model`` under the probe's budget and meter. With
    ``lever`` (the levels the probe searches: checkpointing, or the selective chain) the estimate runs the same level
    search on paper (`estimate_model`'s ``levels``) and seeds each anchor with the estimate's largest fit there."""
    say = log or (lambda _msg: None)

    def seeder(budget_bytes: int, meter: Meter) -> tuple[int | dict[int, int] | None, dict[str, Any] | None]:
        device = "cuda" if next(model.parameters()).device.type == "cuda" else "cpu"
        build, quantized = None, {}
        try:
            why = unsupported_reason(model, autocast_dtype) or lever_reason(lever)
            if why is None:
                build, quantized = builder_like(model), quantization_of(model)
        except Exception as exc:  # noqa: BLE001 -- any failure means: search as before
            why = f"cannot rebuild it from its config ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        if build is None:
            say(f"estimate skipped ({why}): the search starts from micro-batch 1")
            return None, None
        shards = parallel.fsdp2_shards(model) if lever is None and not quantized else None
        key = json.dumps([build.key, seq_len, target_batch_size, meter.capacity_bytes(), device, world_size,
                          budget_bytes, autocast_dtype is torch.bfloat16, max_micro_batch, levels_key(lever),
                          quantized, expandable_from_env(), shards], default=str)
        settings = dict(seq_len=seq_len, target_batch_size=target_batch_size, world_size=world_size,
                        budget_bytes=budget_bytes, bf16=autocast_dtype is torch.bfloat16,
                        max_micro_batch=max_micro_batch, device=device)
        make = (_sharded_maker(build, shards, **settings) if shards else
                _maker(build, meter.capacity_bytes(), lever, quantized, **settings))
        try:
            record, levels, made = made_once(key, make)
        except Exception as exc:  # noqa: BLE001 -- an estimate never stops a probe
            say(f"estimate failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): the search starts "
                "from micro-batch 1")
            return None, None
        if lever is None:
            how = f"{record['sharded']}, " if shards else ""
            say(f"estimate ({device}, fake tensors, {how}{made}): largest fit {record['largest_fit']}; "
                f"the search starts there")
            return max(1, record["largest_fit"]), record
        if levels != lever.count:
            say(f"estimate skipped (it has {levels} checkpointing levels, the model {lever.count}): the search "
                "starts from micro-batch 1")
            return None, None
        seeds = {int(k): max(1, fit) for k, fit in record["levels"].items()}
        say(f"estimate ({device}, fake tensors, {made}): largest fit per {lever.name} level "
            + ", ".join(f"{k}: {fit}" for k, fit in record["levels"].items())
            + "; each level's search starts there")
        return seeds, record

    return seeder


def _maker(build, capacity: int, lever, quantized: dict[str, Any], *, seq_len: int, target_batch_size: int,
           world_size: int, budget_bytes: int, bf16: bool, max_micro_batch: int | None, device: str):
    """The one-process estimate (`estimate_model`) as `made_once`'s ``make``: (record, level count)."""

    def make() -> tuple[dict[str, Any], Any]:
        began = time.perf_counter()
        try:
            result = estimate_model(build, seq_len=seq_len, target_batch_size=target_batch_size,
                                    device_memory=capacity, device=device, world_size=world_size,
                                    budget_bytes=budget_bytes, bf16=bf16, max_micro_batch=max_micro_batch,
                                    all_peaks=False, levels=lever, **quantized).result
        except NothingFitsError as exc:
            result = exc.result
        return (estimate_record(result, device, time.perf_counter() - began),
                result.extra.get("checkpointing", {}).get("num_layers"))

    return make


def _sharded_maker(build, shards: int, *, seq_len: int, target_batch_size: int, world_size: int, budget_bytes: int,
                   bf16: bool, max_micro_batch: int | None, device: str):
    """The sharded estimate for FSDP2 over ``shards`` ranks (`seed_sharded`) as `made_once`'s ``make``."""
    from .seed_sharded import sharded_record

    per_rank = max(1, target_batch_size // world_size)
    cap = per_rank if max_micro_batch is None else min(per_rank, max_micro_batch)

    def make() -> tuple[dict[str, Any], Any]:
        began = time.perf_counter()
        return sharded_record(build, shards=shards, seq_len=seq_len, budget_bytes=budget_bytes, cap=cap,
                              device=device, bf16=bf16, seconds=lambda: time.perf_counter() - began), None

    return make


def made_once(key: str, make: Callable[[], tuple[dict[str, Any], Any]]) -> tuple[dict[str, Any], Any, str]:
    """``make()``'s (record, level count) for ``key``, made once per process (`MADE`), and how the log line says
    where it came from: its seconds, or made earlier. Each caller gets its own copy of the record."""
    if key in MADE:
        MADE.move_to_end(key)
        record, levels = MADE[key]
        return json.loads(json.dumps(record)), levels, "made earlier in this process for the same model and settings"
    record, levels = make()
    MADE[key] = json.loads(json.dumps(record)), levels
    while len(MADE) > MADE_LIMIT:
        MADE.popitem(last=False)
    return record, levels, f"{record['seconds']:.1f} s"


def levels_key(lever: Any) -> Any:
    """What the level search on paper depends on: the lever's fields but its model (the paper model replaces it)."""
    import dataclasses

    if lever is None:
        return None
    return [type(lever).__qualname__, {f.name: getattr(lever, f.name) for f in dataclasses.fields(lever)
                                       if f.name != "model"}]


def lever_reason(lever: Any) -> str | None:
    """Why the estimate cannot run the level search of ``lever`` on paper, None when it can: its levels must be a
    dataclass over the model (``model`` field: the checkpointing and selective levers'), set again on the paper one."""
    import dataclasses

    if lever is None or (dataclasses.is_dataclass(lever) and "model" in {f.name for f in dataclasses.fields(lever)}):
        return None
    return f"the {lever.name} lever's levels cannot be set on the estimate's model"


def estimate_record(result: ProbeResult, device: str, seconds: float) -> dict[str, Any]:
    """What the plan file keeps of the estimate: its largest fit, its peak at every size it ran, its line."""
    checkpointing = result.extra.get("checkpointing")
    chosen = None if checkpointing is None else checkpointing["chosen_k"]
    peaks = {t.micro_batch_size: t.peak_bytes for t in result.trials
             if t.peak_bytes is not None and t.checkpointed_layers == chosen}
    record = {"largest_fit": result.max_micro_batch_size, "device": device, "seconds": round(seconds, 3),
              "peaks": {str(k): v for k, v in sorted(peaks.items())},
              "fitted": None if result.fitted is None else [result.fitted[0], result.fitted[1]]}
    if checkpointing is not None:  # the level search on paper: each level's largest fit and peaks, and its choice
        record["chosen_k"] = chosen
        record["levels"] = {str(lv["k"]): lv["largest_fit"] for lv in checkpointing["levels"]}
        level_peaks: dict[str, dict[str, int]] = {}
        for t in result.trials:
            if t.peak_bytes is not None:
                level_peaks.setdefault(str(t.checkpointed_layers), {})[str(t.micro_batch_size)] = t.peak_bytes
        record["level_peaks"] = level_peaks
    return record


def trainer_reason(trainer) -> str | None:
    """Why the estimate cannot stand for ``trainer``'s step, None when it can: it models the model's own loss
    (``model(**batch).loss``), or AccumSFTTrainer's (TRL's fused LM head, which `builder_like` puts on the paper
    model as the trainer's model carries it; the nll loss, no label smoothing); any other ``compute_loss`` override
    or a ``compute_loss_func`` is a different step."""
    from ..compat.trainer_internals import computes_own_loss

    if not computes_own_loss(trainer):
        return None
    if trainer.compute_loss_func is not None:
        return "compute_loss_func is set: the estimate models the model's own loss"
    if _sft_step(trainer):
        if trainer.args.loss_type != "nll" or trainer.label_smoother is not None:
            return (f"AccumSFTTrainer with loss_type={trainer.args.loss_type!r} / label smoothing: the estimate "
                    "models TRL's nll loss")
        return None
    return f"{type(trainer).__name__}.compute_loss is its own loss, not the model's, which is what the estimate models"


def _sft_step(trainer) -> bool:
    """Whether ``trainer``'s loss is AccumSFTTrainer's own (not overridden again): the class that defines its
    ``compute_loss`` declares ``estimated_loss`` itself (read without importing hf_accum.trl)."""
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in c.__dict__)
    return owner.__dict__.get("estimated_loss") == "trl_fused_head"


def unsupported_reason(model: torch.nn.Module, autocast_dtype: torch.dtype | None) -> str | None:
    """Why the estimate cannot stand for ``model``'s step, None when it can."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vocab_size", None) is None:
        return "not a transformers causal LM with a config"
    try:
        quantization_of(model)
    except ValueError as exc:
        return str(exc)
    if autocast_dtype is not None and autocast_dtype is not torch.bfloat16:
        return f"{autocast_dtype} autocast is not modelled (bf16 is)"
    return None


def _fused_patch(model: torch.nn.Module):
    from ..levers.kernels.fused_loss import causal_lm_module

    inner = causal_lm_module(model)
    patch = None if inner is None else getattr(inner.__dict__.get("forward"), "_hf_accum_fused_loss", None)
    return patch if patch is not None and patch.active else None


def quantization_of(model: torch.nn.Module) -> dict[str, Any]:
    """`estimate_model`'s quantization keywords for ``model``'s base (`paper_quantized.quantization_keywords` of its
    ``config.quantization_config``): {} when not quantized; ValueError for a quantization the estimate does not
    model (another method than bitsandbytes, FP4)."""
    from transformers.utils.quantization_config import QuantizationMethod

    from .paper_quantized import quantization_keywords

    quantization = getattr(model.config, "quantization_config", None)
    if quantization is None:
        if any(getattr(model, f"is_loaded_in_{b}bit", False) for b in (4, 8)):
            raise ValueError("a quantized base without its quantization_config is not modelled")
        return {}
    quantization = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = quantization.get("quant_method", QuantizationMethod.BITS_AND_BYTES)
    if method != QuantizationMethod.BITS_AND_BYTES:  # a str enum: equal to its value, "bitsandbytes"
        raise ValueError(f"a {method} quantized base is not modelled (bitsandbytes' NF4 and int8 are)")
    kind = quantization.get("bnb_4bit_quant_type", "fp4")  # BitsAndBytesConfig's default
    if quantization.get("load_in_4bit") and kind != "nf4":
        raise ValueError(f"a {kind} 4-bit base is not modelled (bitsandbytes' NF4 and int8 are)")
    keywords = quantization_keywords(quantization)
    if not keywords:
        raise ValueError("a quantized base that is neither bitsandbytes 4-bit nor 8-bit is not modelled")
    return keywords


def builder_like(model: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """A callable building ``model`` again from its config (and its LoRA config), unquantized (`quantization_of`
    gives the estimate the quantization), with the same parameters trainable and in the same dtypes (TRL's bfloat16
    adapters on a quantized base), the same layers checkpointed (non-reentrant), TRL's fused LM head
    (`compat.trl_internals.add_trl_fused_head`, the same outputs) or the fused loss where ``model`` has it; ValueError where
    the names differ. Its ``key`` (a string) names all it depends on."""
    import copy

    from ..compat.trl_internals import add_trl_fused_head, fused_lm_head_outputs
    from ..levers.checkpointing import enable_checkpointing

    peft_config = _peft_config(model)
    base = model.get_base_model() if peft_config is not None else model
    dtype = model.get_input_embeddings().weight.dtype
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):  # the base as it is before quantizing: the estimate quantizes it
        del config.quantization_config
    if getattr(config, "distributed_config", None) is not None:  # sharded at load: the estimate shards on paper
        config.distributed_config = None
    model_class = parallel.unsharded_class(type(base))  # FSDP2's FSDP<Name> is built as <Name>
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    dtypes = {name: p.dtype for name, p in model.named_parameters() if p.dtype.is_floating_point}
    trl_head = fused_lm_head_outputs(base)
    patch = _fused_patch(model)
    fused, kernel = patch is not None, patch.kernel if patch is not None else None  # a pinned kernel, on paper too
    checkpointed = {name: m.gradient_checkpointing for name, m in model.named_modules()
                    if isinstance(getattr(m, "gradient_checkpointing", None), bool)}

    def build() -> torch.nn.Module:
        from ..levers.kernels.fused_loss import patch_model

        built = model_class._from_config(config, dtype=dtype)  # its own class: a head or an encoder-decoder too
        if any(checkpointed.values()):
            enable_checkpointing(built, SimpleNamespace(gradient_checkpointing=True,
                                                        gradient_checkpointing_kwargs={"use_reentrant": False}))
        if trl_head is not None:  # as SFTTrainer adds it: on the base, before (under) the adapters
            add_trl_fused_head(built, trl_head)
        if peft_config is not None:
            from peft import get_peft_model

            built = get_peft_model(built, peft_config)
        names = dict(built.named_parameters())
        if names.keys() != trainable.keys():
            raise ValueError("its parameters differ from those of a model built from its config")
        for name, p in names.items():
            p.requires_grad_(trainable[name])
            if name in dtypes and p.dtype != dtypes[name]:
                p.data = p.data.to(dtypes[name])
        for name, m in built.named_modules():  # the layers the model checkpoints, and only those
            if name in checkpointed and isinstance(getattr(m, "gradient_checkpointing", None), bool):
                m.gradient_checkpointing = checkpointed[name]
        if fused:
            patch_model(built)
            if kernel is not None:
                _fused_patch(built).kernel = kernel
        return built

    build.key = _build_key(model, model_class, config, dtype, peft_config,
                           trl_head=trl_head, fused=fused, kernel=kernel, checkpointed=checkpointed)
    return build


def _build_key(model, model_class, config, dtype, peft_config, **rest: Any) -> str:
    """What `builder_like`'s build() depends on, as one string: equal keys build equal models (`MADE`)."""
    return json.dumps({
        "class": f"{model_class.__module__}.{model_class.__qualname__}", "config": config.to_json_string(),
        "attention": config._attn_implementation,
        "dtype": str(dtype), "peft": None if peft_config is None else peft_config.to_dict(),
        "parameters": [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()],
        **rest,
    }, sort_keys=True, default=str)


def _peft_config(model: torch.nn.Module):
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    active = getattr(model, "active_adapter", None)
    return configs[active if isinstance(active, str) and active in configs else next(iter(configs))]
