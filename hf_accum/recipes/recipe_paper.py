"""A recipe on paper: `hf-accum probe --estimate RECIPE [key=value ...]` estimates what `hf-accum train RECIPE`
trains, nothing loaded: the recipe's model built from its config (the tiny model from its `tiny:` keys) on the meta
device, its dtype, LoRA (modules_to_save too), quantization, preference pairs, checkpointing, the trainer's loss and
optimizer, at the length the probe measures (the longest training example where the data is local, tokenized as the
trainer tokenizes it; else the truncation length), and the plan line the trainer prints.

`settings` is the pure part (the recipe and its training arguments -> `PaperRecipe`, the estimate's keywords);
`data_length` reads the data; `builder` builds the model; `run` is the command.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..compat.trl_internals import add_trl_fused_head, trl_fuses_lm_head
from ..probing.paper_quantized import quantization_keywords

#: model.task -> the estimate's head (its `task` keyword)
HEADS = {"causal_lm": "causal_lm", "dpo": "causal_lm", "seq_cls": "classification"}
#: the optimizers the estimate runs: torch's AdamW (its kernel keywords passed on)
ADAMW = ("adamw_torch", "adamw_torch_fused")  # transformers' OptimizerNames


@dataclass(frozen=True)
class PaperRecipe:
    """What the estimate needs of a recipe: how to build its model and the keywords of `estimate_model`."""

    model: str  # "tiny", a hub id or a folder
    head: str  # "causal_lm" or "classification"
    tiny: dict[str, Any] = field(default_factory=dict)  # hf_accum.tiny.build_model keywords (model "tiny")
    dtype: str | None = None  # model.dtype
    num_labels: int | None = None  # classification: None reads the data (as the recipe does), 2 without it
    lora: dict[str, Any] = field(default_factory=dict)  # peft.LoraConfig keywords, task_type included
    kbit_preparation: str = "light"
    trl_fused_head: bool = False  # the loss: TRL's fused LM head (AccumSFTTrainer), else the model's own
    bf16_adapters: bool = False  # TRL's trainers cast a quantized base's trainable weights to bfloat16 (QLoRA)
    device: str | None = None  # "cpu" where training.use_cpu, else None (this machine's)
    seq_len: int | None = None  # training.probe_seq_len (else the data's longest, else max_length)
    max_length: int | None = None  # the truncation length: the bound where the data is not local
    keywords: dict[str, Any] = field(default_factory=dict)  # estimate_model's keywords (non-default ones only)


def settings(recipe, args) -> PaperRecipe:
    """The estimate of ``recipe`` (`recipes.config.Recipe`, overrides applied) with its validated training
    ``args``: pure, nothing built or read. ValueError (one line) for what the estimate does not model."""
    from ..config.settings import Settings
    from ..levers.checkpointing import requested

    m, task = recipe.model, recipe.model.task
    if task == "grpo":
        raise ValueError("--estimate does not model GRPO recipes: each optimizer step first generates the "
                         "completions it trains on, and generation's memory is not modelled; probe it for real: "
                         f"hf-accum probe {recipe.name}")
    if not args.tunes:
        raise ValueError("the estimate plans target_batch_size: set target_batch_size=N and auto_tune=true")
    if args.fp16:
        raise ValueError("--estimate models bf16 autocast, not fp16: set bf16=true fp16=false, or probe for real")
    if args.optim not in ADAMW:
        raise ValueError(f"optim={args.optim} is not modelled (the estimate runs torch's AdamW): set "
                         "optim=adamw_torch, or probe for real")
    keywords: dict[str, Any] = {
        "target_batch_size": args.target_batch_size, "world_size": args.world_size,
        "budget_bytes": args.memory_budget_bytes,
        "budget_fraction": None if args.memory_budget_bytes is not None else args.memory_budget,
        "bf16": bool(args.bf16), "max_micro_batch": args.probe_max_micro_batch,
        "optimizer": {"fused": True} if args.optim == "adamw_torch_fused" else {},
    }
    head = HEADS[task]
    if head != "causal_lm":
        keywords["task"] = head
    want = requested(args)  # "auto", K, True (every layer) or False, as the trainer reads it
    checkpoint = "all" if want is True else None if want is False or want == 0 else want
    if checkpoint is not None:
        keywords["checkpoint_layers"] = checkpoint
    keywords.update(quantization_keywords(m.quantization))
    quantization = keywords.get("quantization")
    if task == "dpo":
        keywords["pairs"] = "dpo"
    lora = dict(recipe.lora)
    lora.setdefault("task_type", recipe.lora_config().task_type)
    return PaperRecipe(
        model=m.name, head=head, tiny=dict(m.tiny), dtype=m.dtype, num_labels=m.num_labels, lora=lora,
        kbit_preparation=m.kbit_preparation,
        trl_fused_head=task == "causal_lm" and Settings(args).fused_loss is not False and trl_fuses_lm_head(),
        bf16_adapters=quantization is not None and task in ("causal_lm", "dpo"),
        device="cpu" if args.use_cpu else None, seq_len=args.probe_seq_len,
        max_length=recipe.data.max_length if task == "seq_cls" else args.max_length, keywords=keywords)


# --- the data: the length the probe measures at ----------------------------------------------------------------
def data_is_local(recipe) -> bool:
    return recipe.data.dataset == "tiny" or Path(recipe.data.dataset).exists()


def data_length(recipe, args, paper: PaperRecipe, tokenizer) -> tuple[int, str]:
    """The sequence length the probe measures at, and where it came from: probe_seq_len when set; else the longest
    training example (picked as the probe picks it, `planning.data_scan`), tokenized and truncated as the trainer
    does, where the data is local; else the truncation length."""
    from ..planning.data_scan import longest_index
    from ..planning.probe_rows import sequence_length

    if paper.seq_len is not None:
        return paper.seq_len, "training.probe_seq_len"
    if data_is_local(recipe) and tokenizer is not None:
        from .data import build_data

        data = build_data(recipe, tokenizer)
        task = recipe.model.task
        if task == "seq_cls":
            return data.longest, f"the longest of {len(data.dataset)} training examples"
        from datasets.utils.logging import disable_progress_bar, enable_progress_bar

        from ..compat.trl_internals import prepared_dataset

        disable_progress_bar()  # TRL's map bars: the estimate prints its own lines
        try:
            rows = prepared_dataset(task, data.dataset, tokenizer, args)
        finally:
            enable_progress_bar()
        what, length = "examples", sequence_length
        if task == "dpo":  # a pair's row as the trainer's collator builds it (the probe's pick, `integrations.trl.support`)
            from ..integrations.trl.support import dpo_row_length

            what, length = "pairs", lambda r: dpo_row_length(r, args.max_length) or sequence_length(r)
        lengths = [length(r) for r in rows]
        return lengths[longest_index(lengths)], f"the longest of {len(rows)} training {what}, tokenized as the trainer does"
    if paper.max_length is None:
        raise ValueError("the data is not local and training.max_length is unset, so the longest example is "
                         "unknown: set probe_seq_len=N (the longest sequence training will see)")
    where = "data.max_length" if recipe.model.task == "seq_cls" else "training.max_length"
    why = "the data is not local" if not data_is_local(recipe) else "the tokenizer is not available offline"
    return paper.max_length, f"{where} ({why})"


# --- the model ------------------------------------------------------------------------------------------------
def builder(paper: PaperRecipe, tokenizer=None, revision: str | None = None, trust_remote_code: bool = False):
    """A callable building the recipe's model (run on the meta device by the estimate): the base from its config
    (the tiny model from its keys and ``tokenizer``), TRL's fused LM head where the trainer adds it, then LoRA as
    `loading.add_lora` adds it for training."""
    import torch

    dtype = None if paper.dtype in (None, "auto") else getattr(torch, paper.dtype)
    kind = "seq_cls" if paper.head == "classification" else "causal_lm"
    num_labels = paper.num_labels or 2
    if paper.model == "tiny":
        from .. import tiny

        base = functools.partial(tiny.build_model, kind, tokenizer=tokenizer, num_labels=num_labels, dtype=dtype,
                                 **paper.tiny)
    else:
        base = _from_config(paper, kind, num_labels, dtype, tokenizer, revision, trust_remote_code)

    def build():
        from peft import LoraConfig

        from ..probing.loading import add_lora

        model = base()
        if paper.trl_fused_head:
            add_trl_fused_head(model)
        model = add_lora(model, LoraConfig(**paper.lora), quantized="quantization" in paper.keywords,
                         kbit_preparation=paper.kbit_preparation,
                         checkpointing="checkpoint_layers" in paper.keywords)
        if paper.bf16_adapters:  # as SFTTrainer/DPOTrainer.__init__ do on a quantized base (the QLoRA paper's dtype)
            for name, p in model.named_parameters():
                if p.requires_grad and "lora_magnitude_vector" not in name:  # DoRA's magnitude stays (TRL #7268)
                    p.data = p.data.to(torch.bfloat16)
        return model

    return build


def _from_config(paper, kind, num_labels, dtype, tokenizer, revision, trust_remote_code):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from ..probing.paper import load_config

    config = load_config(paper.model)
    if kind == "seq_cls":
        config.num_labels = num_labels
        if tokenizer is not None:
            config.pad_token_id = tokenizer.pad_token_id
    auto = AutoModelForSequenceClassification if kind == "seq_cls" else AutoModelForCausalLM
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return functools.partial(auto.from_config, config, trust_remote_code=trust_remote_code or None, **kwargs)


# --- the command ------------------------------------------------------------------------------------------------
def prepare(recipe_name: str, overrides=(), device: str | None = None):
    """(recipe, args, paper, tokenizer): the recipe loaded as `hf-accum train` loads it on ``device`` (its machine
    values: bf16 and bfloat16 weights on cuda; None: this machine's), its settings on paper, and its tokenizer where one
    is available offline (None otherwise)."""
    from .config import RecipeError, load_recipe
    from .model import build_tokenizer

    recipe = load_recipe(recipe_name, overrides, device=device.split(":")[0] if device else None)
    args = _validate_on_paper(recipe)
    paper = settings(recipe, args)
    try:
        tokenizer = build_tokenizer(recipe)
    except (RecipeError, OSError):
        tokenizer = None  # a hub model not in the cache: the length is the truncation length
    return recipe, args, paper, tokenizer


def _validate_on_paper(recipe):
    """`recipe.validate()`; bf16 for a GPU estimated on a machine without one (TrainingArguments refuses bf16 where
    torch sees no GPU) is checked as bf16=false and estimated as set."""
    import torch

    if not recipe.training.get("bf16") or torch.cuda.is_available():
        return recipe.validate()
    recipe.training["bf16"] = False
    try:
        args = recipe.validate()
    finally:
        recipe.training["bf16"] = True
    args.bf16 = True
    return args


def estimate_recipe(recipe_name: str, overrides=(), *, device: str | None = None, device_memory: int | None = None,
                    also: tuple[int, ...] = (), all_peaks: bool = True, log=None, say=None):
    """(estimate, seq_len, where the length came from, paper) of the recipe, as `hf-accum probe --estimate` runs it.
    ``device``: default the recipe's (cpu where training.use_cpu), else this machine's; ``device_memory``: default
    this machine's. ``also``, ``all_peaks``: as `estimate_model`'s. ``say``: told once the recipe is accepted, before
    the data is read."""
    from ..probing.estimate import estimate_model
    from ..probing.paper import machine_device, machine_memory

    recipe, args, paper, tokenizer = prepare(recipe_name, overrides, device)
    if recipe.model.name == "tiny" and tokenizer is None:
        raise ValueError("the tiny model's tokenizer could not be built")
    device = device or paper.device or machine_device()
    memory = device_memory if device_memory is not None else machine_memory(device, "--device-memory")
    if say is not None:
        say(f"recipe {recipe.name} on paper for {device} with {memory / 2**30:.1f} GiB (fake tensors: nothing "
            "loaded, no weights read) ...")
    seq_len, source = data_length(recipe, args, paper, tokenizer)
    build = builder(paper, tokenizer, recipe.model.revision, recipe.model.trust_remote_code)
    est = estimate_model(build, seq_len=seq_len, device=device, device_memory=memory, also=also, all_peaks=all_peaks,
                         log=log, **paper.keywords)
    if paper.trl_fused_head:
        est.loss = ("loss: TRL's fused LM head (trl add_fused_lm_head: log-probs, entropy and top-1 in chunks, no "
                    "full logits), as AccumSFTTrainer computes it")
        est.result.extra["loss"] = est.loss
    return est, seq_len, source, paper


def run(args: Any, say=print) -> int:
    """`hf-accum probe --estimate RECIPE [key=value ...]`: the table, the summary and the trainer's plan line."""
    import json

    from ..probing.paper import parse_size
    from ..probing.report import plan_figures, plan_line, summary, table

    memory = parse_size(args.device_memory) if args.device_memory else None
    est, seq_len, source, paper = estimate_recipe(args.recipe, args.overrides, device=args.device,
                                                  device_memory=memory, log=lambda msg: say(f"  {msg}"), say=say)
    what = [f"model {paper.model}", f"weights {paper.dtype or 'float32'}", f"seq {seq_len} "
            f"({source})", f"LoRA r={paper.lora.get('r', 8)}"]
    what += [f"{k}={v}" for k, v in paper.keywords.items() if k in ("quantization", "pairs", "checkpoint_layers")]
    say("estimated: " + ", ".join(what))
    say("")
    say(table(est.result, seq_len))
    say("")
    budget_source = ("training.memory_budget_bytes" if paper.keywords["budget_bytes"] else
                     f"training.memory_budget={paper.keywords['budget_fraction']} of {est.device} memory")
    say(summary(est.result, est.plan, seq_len, budget_source))
    say("predicted peak per micro-batch: " + ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in est.peaks.items()))
    say(f"assumed: {est.loss}")
    for line in est.assumptions:
        say(f"assumed: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**est.to_json(), "recipe": args.recipe, "overrides": list(args.overrides),
                       "seq_len_source": source}, f, indent=2, default=str)
        say(f"wrote {args.json}")
    figures = plan_figures(est.plan, est.result.budget_bytes, est.result.to_dict(), reused=False)
    say(plan_line(est.plan, figures) + " (estimated)")
    return 0
