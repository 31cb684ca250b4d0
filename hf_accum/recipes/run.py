"""Step 4 of a recipe: the run. Plan micro x accumulation x world = target with the memory probe, print the plan
and tokens per optimizer step, train, and write the adapter, the tokenizer, `recipe.yaml` and `run_summary.json`.
:func:`load_trained` rebuilds the trained model from an output directory."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import preflight
from .config import Recipe, RecipeError, _quiet_deprecations, load_recipe, write_recipe
from .data import build_data, grpo_stats, preference_stats, sft_stats
from .model import add_lora, build_model, build_tokenizer, check_layers_requested
from .profile import toy_warning
from .rewards import REWARDS
from .summary import describe, run_summary

SUMMARY_FILE = "run_summary.json"
RECIPE_FILE = "recipe.yaml"


@dataclass
class RecipeRun:
    recipe: Recipe
    trainer: Any
    model: Any
    tokenizer: Any
    summary: dict[str, Any]
    output_dir: str


def run_recipe(
    recipe: str | os.PathLike | dict[str, Any] | Recipe,
    overrides: Sequence[str] = (),
    *,
    say: Callable[[str], None] | None = None,
    callbacks: Sequence[Any] = (),
    resume_command: str | None = None,
) -> RecipeRun:
    """Load, check the output directory, build, plan, train, save. ``say`` prints the plan and results (default:
    print on the main process)."""
    start = time.perf_counter()
    recipe, args = _load(recipe, overrides)
    target = preflight.requested_target(args)
    preflight.check_output_dir(args.output_dir, target)
    resume = preflight.resolve_resume(args.resume_from_checkpoint, args.output_dir, target)
    args.resume_from_checkpoint = resume
    main_process = args.process_index == 0
    say = say or (print if main_process else (lambda _msg: None))
    started = _train_start()
    with _cpu_threads(recipe.model.cpu_threads, args), _startup_interrupt(args, started):
        return _run(recipe, args, resume, say, callbacks, start, main_process, resume_command, started)


class StoppedBeforeTraining(KeyboardInterrupt):
    """Ctrl-C while loading, tokenizing or probing: nothing was trained, output_dir is as it was."""


@contextlib.contextmanager
def _startup_interrupt(args, started):
    """A Ctrl-C before training began (loading, tokenizing, probing) ends as one line, with output_dir as it was: a
    folder this run made is removed again, a plan file the probe rewrote is put back. Once training began, the
    Trainer's stop (a checkpoint, or a second Ctrl-C at once) is the answer."""
    import shutil

    from ..planning.store import PLAN_FILE

    folder = args.output_dir
    existed = os.path.isdir(folder)
    plan_path = os.path.join(folder, PLAN_FILE)
    plan = open(plan_path, "rb").read() if os.path.isfile(plan_path) else None
    try:
        yield
    except KeyboardInterrupt as exc:
        if started.began or isinstance(exc, StoppedBeforeTraining) or args.process_index != 0:
            raise
        if not existed:
            shutil.rmtree(folder, ignore_errors=True)
        elif plan is not None:
            with open(plan_path, "wb") as f:
                f.write(plan)
        elif os.path.isfile(plan_path):
            os.remove(plan_path)
        where = f"{folder} was not created" if not existed else f"{folder} is as it was"
        raise StoppedBeforeTraining(f"stopped (Ctrl-C) before training began: nothing was trained or written "
                                    f"({where})") from None


# peft's save_pretrained warns on every save (checkpoints too) that it saves the embedding layers, because the recipes
# put embed_tokens in lora.target_modules: saving them is its default then and what the recipes want. Its argument
# (save_embedding_layers=True) cannot be passed: Trainer.save_model forwards no save_pretrained arguments.
_PEFT_SAVES_EMBEDDINGS = "Setting `save_embedding_layers` to `True` as embedding layers found in `target_modules`."


@contextlib.contextmanager
def _quiet():
    """What a recipe's own choices make pointless to print, by exact text: transformers' renamed-checkpointing
    FutureWarnings (the recipes' keys, and TRL's DPO reference forward, use the old names, the only ones the oldest
    supported transformers knows) and peft's embedding-layers note above."""
    import re
    import warnings

    with _quiet_deprecations(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(_PEFT_SAVES_EMBEDDINGS), category=UserWarning)
        yield


def _load(recipe, overrides) -> tuple[Recipe, Any]:
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    elif overrides:
        raise RecipeError("overrides go with a recipe name or path, not with an already loaded Recipe")
    return recipe, recipe.validate()


@contextlib.contextmanager
def _cpu_threads(n: int | None, args):
    import torch

    if n is None or not (args.use_cpu or not torch.cuda.is_available()):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- what `hf-accum train RECIPE` and `hf-accum probe RECIPE` both build --------------------------------------
@dataclass
class Built:
    """The trainer of a recipe with everything it holds. One code path for the run and for `hf-accum probe RECIPE`,
    so the probe measures exactly what the run trains (model, quantization, LoRA, checkpointing, data, collator,
    loss)."""

    recipe: Recipe
    args: Any
    tokenizer: Any
    data: Any
    model: Any
    trainer: Any
    trainable: int
    total: int


def build(recipe: Recipe, args, say: Callable[[str], None], callbacks: Sequence[Any] = ()) -> Built:
    say(f"recipe {recipe.name}" + (f" ({recipe.path})" if recipe.path else ""))

    from transformers import set_seed

    # Seeded before the model is built: the LoRA matrices (and a new head) are initialized from the global RNG,
    # which the Trainer only seeds later, in its __init__. Without this two runs of a recipe differ.
    check_layers_requested(recipe, args)
    set_seed(args.seed)
    tokenizer = build_tokenizer(recipe)
    data = build_data(recipe, tokenizer)
    model = build_model(recipe, tokenizer, num_labels=data.num_labels, use_cpu=args.use_cpu)
    model = add_lora(model, recipe, args)
    trainable, total = _count_parameters(model)
    say(
        f"model {recipe.model.name} ({type(model.get_base_model()).__name__}"
        + _quantization_text(recipe.model.quantization)
        + f"), LoRA r={model.peft_config['default'].r}: {trainable:,} trainable of {total:,} parameters"
    )
    toy = toy_warning(recipe, args, model)  # a pretrained model run with the tiny demonstration's settings
    if toy:
        say(toy)
    trainer = _trainer(recipe, args, model, tokenizer, data, list(callbacks))
    if recipe.model.task == "grpo":  # TRL tokenizes each prompt for generation: count that
        from ..compat.trl_internals import grpo_prompt_lengths

        lengths = grpo_prompt_lengths(trainer, list(trainer.train_dataset["prompt"]))
        data = grpo_stats(data, lengths, args.max_completion_length)
        say(f"data {recipe.data.dataset}: {len(data.dataset)} prompts, {sum(lengths) / len(lengths):.1f} tokens per "
            f"prompt on average (longest {max(lengths)}); {args.num_generations} completions of at most "
            f"{args.max_completion_length} tokens each, rewarded by {', '.join(f.__name__ for f in REWARDS)}")
        return Built(recipe, args, tokenizer, data, model, trainer, trainable, total)
    if recipe.model.task == "dpo":  # TRL tokenized the rows: count what it will forward
        data = preference_stats(data, trainer.train_dataset)
    elif recipe.model.task == "causal_lm":
        data = sft_stats(data, trainer.train_dataset)
    if recipe.model.task == "dpo":  # a pair forwards two sequences; `longest` is one sequence
        say(f"data {recipe.data.dataset}: {len(data.dataset)} pairs, {data.mean_tokens / 2:.1f} tokens per sequence "
            f"on average (two per pair: prompt + chosen, prompt + rejected), longest sequence {data.longest}")
    else:
        say(f"data {recipe.data.dataset}: {len(data.dataset)} {_examples(recipe)}, {data.mean_tokens:.1f} tokens and "
            f"{data.mean_targets:.1f} {_unit(recipe)} per {_example(recipe)} on average, longest {data.longest}")
    return Built(recipe, args, tokenizer, data, model, trainer, trainable, total)


def _trainer(recipe: Recipe, args, model, tokenizer, data, callbacks):
    """The trainer of model.task: AccumSFTTrainer (TRL applies the chat template, tokenizes, masks the prompt and
    collates), AccumDPOTrainer (the same for pairs; the reference model is the base, i.e. the same model with the
    adapter disabled), or AccumTrainer with the recipe's collator (seq_cls)."""
    if recipe.model.task == "grpo":
        from ..trl import AccumGRPOTrainer

        return AccumGRPOTrainer(model=model, args=args, train_dataset=data.dataset, processing_class=tokenizer,
                                reward_funcs=list(REWARDS), callbacks=callbacks)
    if recipe.model.task in ("causal_lm", "dpo"):
        from ..trl import AccumDPOTrainer, AccumSFTTrainer

        trainer_class = AccumDPOTrainer if recipe.model.task == "dpo" else AccumSFTTrainer
        return trainer_class(model=model, args=args, train_dataset=data.dataset, eval_dataset=data.eval_dataset,
                             processing_class=tokenizer, callbacks=callbacks)
    from ..trainer.mixin import AccumTrainer

    return AccumTrainer(model=model, args=args, train_dataset=data.dataset, eval_dataset=data.eval_dataset,
                        data_collator=data.collator, processing_class=tokenizer, callbacks=callbacks)


def _unit(recipe: Recipe) -> str:
    return {"causal_lm": "target tokens", "dpo": "pairs", "grpo": "completions"}.get(recipe.model.task, "labels")


def _example(recipe: Recipe) -> str:
    return "pair" if recipe.model.task == "dpo" else "example"


def _examples(recipe: Recipe) -> str:
    return _example(recipe) + "s"


def _configured_plan(args) -> dict[str, Any]:
    return {
        "micro_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "world_size": args.world_size,
        "target_batch_size": args.effective_batch_size,
    }


# --- probe ------------------------------------------------------------------------------------------------------
@dataclass
class RecipeProbe:
    recipe: Recipe
    plan: Any
    result: Any
    seq_len: int
    plan_file: str | None


def probe_recipe(
    recipe: str | os.PathLike | dict[str, Any] | Recipe,
    overrides: Sequence[str] = (),
    *,
    store: bool = False,
    say: Callable[[str], None] = print,
) -> RecipeProbe:
    """Build what `run_recipe` would train and measure it (`trainer.tune()`, always a fresh probe). With ``store``,
    the plan file is written to the recipe's output_dir, where `hf-accum train` with the same recipe and overrides
    reuses it."""
    import shutil
    import tempfile

    recipe, args = _load(recipe, overrides)
    store_in = args.output_dir if store else None
    if store_in is not None:
        preflight.check_output_dir(store_in, preflight.requested_target(args), what="probe")
    if not args.tunes:
        raise RecipeError("the probe plans target_batch_size: set target_batch_size=N and auto_tune=true")
    scratch = tempfile.mkdtemp(prefix="hf_accum_probe_")
    args.output_dir = scratch  # empty: a plan stored elsewhere is never reused (always a fresh probe)
    try:
        with _cpu_threads(recipe.model.cpu_threads, args):
            built = build(recipe, args, say)
            seq_len = args.probe_seq_len or built.data.longest
            say(f"probing memory: real training steps against a budget of {_budget_text(args)} ...")
            built.trainer.planner.stores_plan = False  # written below where it is kept, or not at all (said once)
            try:
                with _quiet():
                    plan = built.trainer.tune()
            except ValueError as exc:
                exc.seq_len = seq_len  # for the table of what was measured (NothingFitsError.result)
                raise
        plan_file = None
        if store_in is not None:
            plan_file = built.trainer.planner.save(store_in, plan=plan)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return RecipeProbe(recipe, plan, built.trainer.probe_result, seq_len, plan_file)


# --- the run ------------------------------------------------------------------------------------------------------
def _write_recipe_at_start(recipe: Recipe):
    from transformers import TrainerCallback

    class WriteRecipe(TrainerCallback):
        """`recipe.yaml` is written when training starts: after the Trainer's checks passed, so a refused run leaves
        the output directory as it was, and before the first step, so a crash still leaves what was run."""

        def on_train_begin(self, args, state, control, **kwargs):
            if args.should_save:
                os.makedirs(args.output_dir, exist_ok=True)
                write_recipe(recipe, os.path.join(args.output_dir, RECIPE_FILE))

    return WriteRecipe()


def _run(recipe: Recipe, args, resume: str | None, say, callbacks, start: float, main_process: bool,
         resume_command: str | None, started) -> RecipeRun:
    built = build(recipe, args, say, [*callbacks, _write_recipe_at_start(recipe), started])
    trainer = built.trainer
    trainer.resume_command = resume_command
    plan_dict = None
    if resume is not None:  # the Trainer restores the plan stored with the checkpoint (and refuses another target)
        from ..planning.store import load_stored_plan

        stored = load_stored_plan(resume)
        say(f"resuming from {resume}" + (f" with its plan {stored.describe()}" if stored else ""))
    else:
        if args.tunes:
            say(f"planning: the plan stored in output_dir if nothing that changes memory changed, else a memory "
                f"probe (real training steps against a budget of {_budget_text(args)}) ...")
            with _quiet():
                trainer.tune()
            if trainer.args.auto_eval_batch_size is None:  # "on when auto-tuning": resolved before auto_tune goes off
                trainer.args.auto_eval_batch_size = True
            trainer.args.auto_tune = False  # planned once, here; train() must not probe again (nor lose probe_result)
        plan_dict = _plan_in_force(trainer)
        _say_plan(say, built, plan_dict)

    cuda_peak = _reset_cuda_peak(built.model)
    with _quiet():
        result = trainer.train(resume_from_checkpoint=resume)
    final = _plan_in_force(trainer)
    if plan_dict is None:
        _say_plan(say, built, final)
    elif _training_plan(final) != _training_plan(plan_dict):  # out of memory mid-run: a smaller micro
        say(f"the plan was lowered during training (out of memory): {describe(final)}")
    with _quiet():
        trainer.save_model(args.output_dir)  # adapter (adapter_config.json + weights, modules_to_save too) + tokenizer
    evaluation = _evaluate(built, say)

    summary = run_summary(built, result, final, resume, cuda_peak() if cuda_peak else None, start, started)
    summary.update(evaluation)
    if main_process and args.should_save:
        with open(os.path.join(args.output_dir, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    if summary["losses"]:
        say(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} (first and last logged, every "
            f"{args.logging_steps} steps); {summary['steps_this_run']} steps in {summary['train_seconds']:.1f} s, "
            f"{summary['tokens_per_second']:,.0f} tokens/s")
    if summary.get("rewards"):
        say(f"mean reward {summary['first_rewards_mean']:.3f} -> {summary['last_rewards_mean']:.3f} (over the first and "
            f"last {min(10, len(summary['rewards']))} logged steps)")
    say(f"saved the adapter and tokenizer to {args.output_dir}; summary: {os.path.join(args.output_dir, SUMMARY_FILE)} "
        f"(wall time {summary['wall_seconds']:.1f} s)")
    return RecipeRun(recipe, trainer, built.model, built.tokenizer, summary, args.output_dir)


def _training_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan without the eval batch, which the first evaluation during training adds (not a lowering)."""
    return {k: v for k, v in plan.items() if k != "eval_batch_size"}


def _evaluate(built: Built, say) -> dict[str, Any]:
    """The held-out rows (data.eval_examples), evaluated once after training unless an evaluation during training
    already ran at the last step: eval_loss is the exact mean over every target token (pair, example), whatever eval
    batch the trainer planned (hf_accum/window/evaluation.py)."""
    if built.data.eval_dataset is None:
        return {}
    trainer = built.trainer
    evaluations = [h for h in trainer.state.log_history if "eval_loss" in h]
    if evaluations and evaluations[-1].get("step") == trainer.state.global_step:
        metrics = {k: v for k, v in evaluations[-1].items() if k.startswith("eval_")}  # same weights: not run again
    else:
        with _quiet():
            metrics = trainer.evaluate()
    batch = trainer.args.per_device_eval_batch_size
    rows = len(built.data.eval_dataset)
    say(f"eval_loss {metrics['eval_loss']:.4f} on the {rows} held-out {_examples(built.recipe)} (eval batch {batch})")
    return {"eval_loss": metrics["eval_loss"], "eval_examples": rows, "eval_batch_size": batch,
            "eval_metrics": metrics}


def _plan_in_force(trainer) -> dict[str, Any]:
    return trainer.plan.to_dict() if trainer.plan is not None else _configured_plan(trainer.args)


def _say_plan(say, built: Built, plan: dict[str, Any]) -> None:
    """The plan line, unless the tuner just showed it (`probing.report.plan_line`, the same line), then tokens per step."""
    if built.trainer.probe_result is None and not built.args.tunes:
        say(f"hf_accum plan: {describe(plan)}")
    unit = _unit(built.recipe)
    if built.recipe.model.task == "grpo" and built.args.loss_normalization == "tokens":
        unit = "completions' tokens"
    _say_tokens(say, plan["target_batch_size"], built.data, unit, built.args)


def _train_start():
    """A callback holding where this call's training began (a resume starts at the checkpoint's step and tokens): the
    summary's rates are over what this run trained, not over steps an earlier run took."""
    from transformers import TrainerCallback

    class TrainStart(TrainerCallback):
        step, tokens, began = 0, 0, False

        def on_train_begin(self, args, state, control, **kwargs):
            self.step, self.tokens = state.global_step, state.num_input_tokens_seen or 0
            self.began = True

    return TrainStart()


def _say_tokens(say, per_step: int, data, unit: str, args) -> None:
    say(
        f"tokens per optimizer step: {per_step} x {data.mean_tokens:.1f} = ~{per_step * data.mean_tokens:,.0f} "
        f"(~{per_step * data.mean_targets:,.0f} {unit}, over which the loss is averaged: "
        f"loss_normalization={args.loss_normalization})"
    )


def load_trained(output_dir: str, *, use_cpu: bool = True):
    """(model, tokenizer): the base rebuilt from `output_dir/recipe.yaml`, the saved adapter loaded onto it."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    recipe = load_recipe(os.path.join(output_dir, RECIPE_FILE))
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    num_labels = recipe.model.num_labels
    if recipe.model.task == "seq_cls" and num_labels is None:
        num_labels = build_data(recipe, tokenizer).num_labels
    base = build_model(recipe, tokenizer, num_labels=num_labels, use_cpu=use_cpu)
    model = PeftModel.from_pretrained(base, output_dir)
    _adapter_in_saved_dtype(model, output_dir)
    return model, tokenizer


def _adapter_in_saved_dtype(model, output_dir: str) -> None:
    """peft loads adapter weights as float32; TRL trains those of a quantized base in bfloat16 (and saves them so).
    Cast them back, so the reloaded model computes what the trained one did."""
    from safetensors import safe_open

    path = os.path.join(output_dir, "adapter_model.safetensors")
    if not os.path.exists(path):
        return
    with safe_open(path, "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    if dtypes != {"BF16"}:
        return
    import torch

    for name, param in model.named_parameters():
        if ".lora_" in name or ".modules_to_save." in name:
            param.data = param.data.to(torch.bfloat16)


# --- summary helpers ----------------------------------------------------------------------------------------------
def _count_parameters(model) -> tuple[int, int]:
    trainable = total = 0
    for p in model.parameters():
        # A 4-bit weight is stored packed, two values per byte: count the values it holds.
        n = p.numel() * 2 if p.__class__.__name__ == "Params4bit" else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def _reset_cuda_peak(model) -> Callable[[], int] | None:
    import torch

    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return lambda: int(torch.cuda.max_memory_allocated(device))


def _quantization_text(quantization: dict[str, Any] | None) -> str:
    if not quantization:
        return ""
    if quantization.get("load_in_4bit"):
        return f", 4-bit {quantization.get('bnb_4bit_quant_type', 'fp4')}"
    return ", 8-bit" if quantization.get("load_in_8bit") else ""


def _budget_text(args) -> str:
    if args.memory_budget_bytes is not None:
        return _mib(args.memory_budget_bytes)
    return f"{args.memory_budget:.0%} of the device's memory"


def _mib(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


__all__ = ["RECIPE_FILE", "SUMMARY_FILE", "Built", "RecipeProbe", "RecipeRun", "build", "load_trained", "probe_recipe",
           "run_recipe"]
