"""The `hf-accum` console script: `hf-accum probe ...` and `hf-accum train ...`.

Each sub-command owns one `_add_<name>_parser` function (its flags) and one `_run_<name>` function; `main` parses,
dispatches, and turns a user error into one line on stderr and exit status 2 (`--debug` shows the traceback).
Nothing heavy is imported before the arguments are checked: `--help` and argument errors need neither torch nor
transformers, and a command that quantizes nothing never imports bitsandbytes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from . import __version__

# --- probe -------------------------------------------------------------------------------------------
# The offline default must exercise the search: 24 MiB is below what micro-batch 32 of the tiny model needs at
# seq 256 on CPU, so the plan needs accumulation > 1.
DEFAULT_PROBE_BUDGET_BYTES = 24 * 2**20

# Flags of the bare-model probe, and the recipe key that says the same with `hf-accum probe RECIPE`.
BARE_MODEL_FLAGS = {
    "model": "model=...", "seq_len": "probe_seq_len=N", "target_batch": "target_batch_size=N",
    "world_size": "a launch with N processes (torchrun)", "lora": "(recipes always train LoRA)", "lora_r": "lora.r=N",
    "lora_target_modules": "lora.target_modules=[...]", "load_in_4bit": "model.quantization.load_in_4bit=true",
    "load_in_8bit": "model.quantization.load_in_8bit=true", "kbit_preparation": "model.kbit_preparation=...",
    "gradient_checkpointing": "gradient_checkpointing=true", "bf16": "bf16=true", "budget": "memory_budget=F",
    "budget_bytes": "memory_budget_bytes=N", "max_micro_batch": "probe_max_micro_batch=N",
    "optimize": "auto_tune_optimize=...",
}


class UsageError(Exception):
    """A command line that cannot run; the message names the flag or key and what to give instead."""


def _add_probe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe", help="measure peak memory per micro-batch and print the plan (of a recipe, or of a bare model)",
        description="Measure the peak memory of real training steps at increasing micro-batch sizes and plan "
                    "micro-batch x accumulation x world = target. With RECIPE: probe exactly what `hf-accum train "
                    "RECIPE key=value ...` trains (same model, quantization, LoRA, checkpointing, data, collator, "
                    "loss); with output_dir=DIR the plan is stored there and `hf-accum train` reuses it. Without "
                    "RECIPE: a bare model (--model) on random tokens.",
    )
    p.add_argument("recipe", nargs="?", default=None, help="recipe name or YAML path (as for `hf-accum train`)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of recipe keys (with RECIPE)")
    p.add_argument("--model", default="tiny", help="hub id, local directory (save_pretrained), or 'tiny' (offline)")
    p.add_argument("--seq-len", type=_seq_lens, default=256, metavar="N[,N...]",
                   help="sequence length to measure at (default 256); with --estimate a comma list (512,2048,8192) "
                        "gives the what-fits-where table")
    p.add_argument("--target-batch", type=int, default=32, help="effective batch: samples per optimizer step")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks the plan is for")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of all weights")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-target-modules", default=None, help="comma-separated module names (default all-linear)")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--load-in-4bit", action="store_true", help="NF4 base weights (bitsandbytes)")
    q.add_argument("--load-in-8bit", action="store_true", help="LLM.int8 base weights (bitsandbytes, CUDA)")
    p.add_argument("--kbit-preparation", choices=["light", "peft"], default="light",
                   help="quantized base: 'light' (as the recipes: no upcast) or 'peft' (prepare_model_for_kbit_"
                        "training, which upcasts the non-quantized weights to float32)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--checkpoint-layers", default=None, metavar="auto|K",
                   help="'auto': also choose how many decoder layers recompute (measured without and with every "
                        "layer checkpointed, the fastest fitting pair verified); K: exactly the first K layers")
    p.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=None,
                   help="causal-LM loss without the full logits, as training will use it (default: on where "
                        "supported; --fused-loss: required, --no-fused-loss: off)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--budget", type=float, default=None,
                   help="fraction (0, 1] of the memory this process can use now (default 0.9)")
    b.add_argument("--budget-bytes", type=int, default=None,
                   help=f"budget in bytes (default for the tiny model: {DEFAULT_PROBE_BUDGET_BYTES}; otherwise 0.9 "
                        "of the usable memory)")
    p.add_argument("--max-micro-batch", type=int, default=None, help="largest micro-batch to try")
    p.add_argument("--optimize", choices=["memory", "throughput"], default="memory")
    p.add_argument("--json", default=None, help="write the measurements and plan to this JSON file")
    e = p.add_argument_group("estimate (no weights loaded: the model from its config, on fake tensors)")
    e.add_argument("--estimate", action="store_true",
                   help="plan without loading the model or using a device: a bare --model, or RECIPE with its "
                        "overrides (what `hf-accum train RECIPE` trains; the plan line marked 'estimated')")
    e.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="the device to estimate for (default: this machine's, cuda where torch sees one)")
    e.add_argument("--device-memory", default=None, metavar="SIZE[,SIZE...]",
                   help="the card's memory, e.g. 80GiB; a comma list (24GiB,48GiB,80GiB) gives one table of what fits "
                        "on each card (and each --seq-len): the largest micro-batch and the levers it needs")
    e.add_argument("--gpus", default=None, metavar="N[,N...]",
                   help="GPU counts to plan for, sharded (--sharding): one table per --device-memory card, a column "
                        "per count, each cell the largest micro-batch per rank and micro x accumulation x world")
    e.add_argument("--sharding", default=None, metavar="fsdp2|fsdp2-keep|zero1|zero2|zero3[+offload]|DS.json",
                   help="how the ranks shard (with --gpus; default fsdp2): FSDP2 per decoder layer (fsdp2-keep: no "
                        "reshard after forward), DeepSpeed ZeRO-1/2/3 (+offload: the optimizer on CPU), or a "
                        "DeepSpeed config file (its stage, offload and bucket sizes)")
    p.add_argument("--plot", default=None, help="write a PNG of the memory curve to this file")
    p.set_defaults(func=_run_probe)


def _seq_lens(text: str) -> int | list[int]:
    """One sequence length (an int, as always), or a comma list of them (the what-fits-where table)."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(  # one value: argparse's own words for an int flag, as before lists
            f"{text!r}: give an integer or a comma list such as 512,2048,8192" if "," in text
            else f"invalid int value: {text!r}") from None
    return values[0] if len(values) == 1 else values


def _is_grid(args: argparse.Namespace) -> bool:
    """A comma list in --seq-len or --device-memory: the what-fits-where table (`probing/fits.py`)."""
    return isinstance(args.seq_len, list) or "," in (args.device_memory or "")


def _check_output_file(flag: str, path: str | None) -> None:
    """Checked before anything is measured: a bad path must not cost a whole probe."""
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"{flag}={path} is a directory; give a file name, e.g. {flag} {os.path.join(path, 'probe')}"
                         + (".png" if flag == "--plot" else ".json"))
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"{flag}={path}: {folder} is not a writable directory; create it or give another path")


def _check_probe_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.recipe is not None:
        if "=" in args.recipe:
            raise UsageError(f"{args.recipe!r} looks like an override; give the recipe first: "
                             f"hf-accum probe RECIPE {args.recipe}")
        for dest, key in BARE_MODEL_FLAGS.items():
            if vars(args)[dest] != parser.get_default(dest):
                flag = "--" + dest.replace("_", "-")
                raise UsageError(f"{flag} is for a bare model; with a recipe use {key}")
    elif args.overrides:
        raise UsageError(f"key=value overrides ({args.overrides[0]}) go with a recipe: hf-accum probe RECIPE "
                         f"{' '.join(args.overrides)}")
    if args.gradient_checkpointing and args.checkpoint_layers is not None:
        raise UsageError("--checkpoint-layers and --gradient-checkpointing (every layer) contradict each other: give one")
    if _is_grid(args) and not args.estimate:
        flag = "--seq-len" if isinstance(args.seq_len, list) else "--device-memory"
        raise UsageError(f"{flag}: a comma list is for --estimate (what fits where, nothing loaded); the probe "
                         "measures one sequence length on this machine: add --estimate, or give one value")
    for name in ("seq_len", "target_batch", "world_size", "lora_r", "max_micro_batch", "budget_bytes"):
        for value in (vars(args)[name] if isinstance(vars(args)[name], list) else [vars(args)[name]]):
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')}={value} must be a positive integer")
    if args.budget is not None and not 0 < args.budget <= 1:
        raise UsageError(f"--budget={args.budget} must be a fraction in (0, 1]; "
                         "for an absolute budget use --budget-bytes")
    from .probing.plan import indivisible_target

    problem = indivisible_target(args.target_batch, args.world_size, "--target-batch", "--world-size")
    if problem:
        raise UsageError(problem)
    if not args.estimate and (args.gpus is not None or args.sharding is not None):
        flag = "--gpus" if args.gpus is not None else "--sharding"
        raise UsageError(f"{flag} is for --estimate (a plan for GPUs not yet rented, nothing loaded): add --estimate, "
                         "or drop " + flag)
    if not args.estimate and (args.device is not None or args.device_memory is not None):
        flag = "--device" if args.device is not None else "--device-memory"
        raise UsageError(f"{flag} is for --estimate (the device planned for, nothing loaded); the probe measures "
                         "the device it runs on: add --estimate, or drop " + flag)
    _check_output_file("--json", args.json)
    _check_output_file("--plot", args.plot)
    if args.plot:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            raise UsageError("--plot needs matplotlib (the plot extra): pip install matplotlib") from None
        kinds = FigureCanvasBase.get_supported_filetypes()
        suffix = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if suffix not in kinds:
            raise UsageError(f"--plot={args.plot}: the file name must end in an image type matplotlib writes "
                             f"({', '.join('.' + k for k in sorted(kinds))}), e.g. .png")


def _run_probe(args: argparse.Namespace) -> int:
    _check_probe_args(args, args.parser)  # before any model is loaded
    if args.estimate:
        return _estimate(args)
    if args.recipe is not None:
        return _probe_recipe(args)
    _import_bitsandbytes_only_if(args, args.load_in_4bit or args.load_in_8bit)
    import torch

    from .probing import bare
    from .probing.loop import NothingFitsError
    from .probing.report import table
    from .probing.seed import probe_with_estimate

    model = bare.bare_model(args)
    from .probing.probe import seq_len_problem

    too_long = seq_len_problem(model, args.seq_len, "--seq-len")  # the probe's own check names probe_seq_len
    if too_long:
        raise UsageError(too_long)
    lever = bare.checkpoint_lever(args, model)
    from .levers.kernels.fused_loss import patch_model, resolve_for_model

    try:
        fused, why = resolve_for_model(model, args.fused_loss, ("--fused-loss", "--no-fused-loss"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(f"fused loss: {'on' if fused else 'off'} ({why})", flush=True)
    if fused:
        patch_model(model)  # for the probe's training steps; the process ends after the probe
    budget_bytes, source, line = _bare_model_budget(args)
    print(line, flush=True)
    try:
        result, plan = probe_with_estimate(  # the search starts from the estimate's largest fit (one line says)
            model, seq_len=args.seq_len, target_batch_size=args.target_batch, world_size=args.world_size,
            budget_bytes=budget_bytes, budget_fraction=args.budget, budget_names=("--budget-bytes", "--budget"),
            autocast_dtype=torch.bfloat16 if args.bf16 else None, max_micro_batch=args.max_micro_batch,
            optimize=args.optimize, log=lambda msg: print(f"  {msg}", flush=True), lever=lever,
        )
    except NothingFitsError as exc:
        print(table(exc.result, args.seq_len))
        raise
    _report_probe(args, result, plan, args.seq_len, budget_source=source, model=args.model)
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from .probing import paper as command

    why = command.refusal(args)
    try:
        if args.device_memory:  # each size checked first, as ever: a bad one is the line, whatever else
            for size in args.device_memory.split(","):
                if size.strip():
                    command.parse_size(size)
        if why is not None:
            raise ValueError(why)
        if args.gpus is not None or args.sharding is not None:
            if args.recipe is not None:
                raise ValueError("--gpus/--sharding: the sharded estimate is for a bare model (--model); drop RECIPE")
            from .probing import sharded_command

            return sharded_command.run(args)
        if _is_grid(args):
            if args.recipe is not None:
                raise ValueError("--device-memory: a list of cards (what fits where) is for a bare model (--model); "
                                 "with a recipe give one size")
            from .probing import fits

            return fits.run(args)
        if args.recipe is not None:
            from .recipes import recipe_paper

            return recipe_paper.run(args)
        return command.run(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _bare_model_budget(args: argparse.Namespace) -> tuple[int | None, str, str]:
    """The budget in bytes (None: the fraction ``args.budget`` or 0.9), where it came from (short, for the summary
    and the plot) and the line printed before probing."""
    if args.budget_bytes is not None:
        return args.budget_bytes, "--budget-bytes", f"budget: {args.budget_bytes} bytes (--budget-bytes)"
    if args.budget is not None:
        return None, f"--budget {args.budget:g}", f"budget: {args.budget:g} of the memory this process can use (--budget)"
    if args.model == "tiny":
        mib = f"{DEFAULT_PROBE_BUDGET_BYTES / 2**20:g} MiB"
        return DEFAULT_PROBE_BUDGET_BYTES, "the default for --model tiny", (
            f"budget: {mib}, the default for --model tiny: less than micro-batch 32 needs at seq 256, so the plan "
            "shows accumulation (set --budget or --budget-bytes for another)")
    return None, "the default, 0.9", ("budget: 0.9 of the memory this process can use, the default (set --budget or "
                                      "--budget-bytes for another)")


def _probe_recipe(args: argparse.Namespace) -> int:
    from .recipes.config import load_recipe, wants_quantization

    _import_bitsandbytes_only_if(args, wants_quantization(args.recipe, args.overrides))
    recipe = load_recipe(args.recipe, args.overrides)  # every value a rule can check, before torch is imported
    store = any(item.partition("=")[0].strip() in ("output_dir", "training.output_dir") for item in args.overrides)
    if store:
        from .recipes.preflight import check_writable

        check_writable(str(recipe.training["output_dir"]))
    from .probing.loop import NothingFitsError
    from .probing.report import table
    from .recipes.run import probe_recipe

    try:
        out = probe_recipe(recipe, store=store, say=lambda msg: print(msg, flush=True))
    except NothingFitsError as exc:
        print(table(exc.result, getattr(exc, "seq_len", 0)))
        raise
    training = out.recipe.training
    source = ("training.memory_budget_bytes" if training.get("memory_budget_bytes")
              else f"training.memory_budget={training.get('memory_budget', 0.9)}")
    _report_probe(args, out.result, out.plan, out.seq_len, budget_source=source, model=out.recipe.model.name)
    if out.plan_file:
        print(f"stored the plan in {out.plan_file}: `hf-accum train {args.recipe} {' '.join(args.overrides)}` "
              "reuses it without probing")
    else:
        print("plan not stored: add output_dir=DIR to store it where `hf-accum train` reuses it")
    return 0


def _report_probe(args: argparse.Namespace, result, plan, seq_len: int, *, budget_source: str | None = None,
                  model: str | None = None) -> None:
    from .probing.report import summary, table, write_json, write_plot

    print()
    print(table(result, seq_len))
    print()
    print(summary(result, plan, seq_len, budget_source))
    if args.json:
        write_json(args.json, result, plan, seq_len)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, result, plan, seq_len=seq_len, model=model, budget_source=budget_source)
        print(f"wrote {args.plot}")


# --- train -------------------------------------------------------------------------------------------
def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    from .recipes.files import available_recipes, recipe_dirs  # read the folder; import neither torch nor yaml

    p = sub.add_parser(
        "train", help="run a recipe (a name from recipes/ or a YAML path) with key=value overrides",
        formatter_class=_WholePaths,
        description="Run a LoRA / QLoRA recipe: probe memory (or reuse the plan stored in output_dir), plan "
                    "micro-batch x accumulation x world = target_batch_size, train, save the adapter and "
                    "run_summary.json in output_dir.",
        epilog="Overrides: section.key=value (model.dtype=bfloat16, lora.r=32, training.learning_rate=1e-4), a bare "
               "key when one section has it (max_steps=100), model=HUB_ID_OR_DIR, dataset=HUB_ID_OR_FILE. Values "
               "are YAML scalars. Checkpoints: save_steps=N; continue a run with resume_from_checkpoint=true (the "
               "newest complete checkpoint in output_dir) or =PATH. Recipes: "
               f"{', '.join(available_recipes())} (the YAML files in {recipe_dirs()[0] if recipe_dirs() else '-'}).",
    )
    p.add_argument("recipe", help="recipe name (e.g. lora_sft) or path of a recipe YAML file")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="overrides of recipe keys")
    p.add_argument("--print-config", action="store_true",
                   help="check the resolved recipe (after overrides), print it and exit without training")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from .recipes.config import load_recipe, wants_quantization

    _import_bitsandbytes_only_if(args, wants_quantization(args.recipe, args.overrides))
    recipe = load_recipe(args.recipe, args.overrides)  # every value a rule can check, before torch is imported
    if args.print_config:
        from .recipes.config import format_recipe

        recipe.validate()
        print(format_recipe(recipe), end="")
        return 0
    from .recipes.run import run_recipe  # load_recipe checked output_dir can be written; run_recipe checks the rest

    run_recipe(recipe, resume_command=resume_command(args.recipe, args.overrides))
    return 0


def resume_command(recipe: str, overrides: list[str]) -> str:
    """The command line that continues this run from its newest checkpoint."""
    import shlex

    kept = [o for o in overrides if o.partition("=")[0].strip() not in ("resume_from_checkpoint",
                                                                          "training.resume_from_checkpoint")]
    return shlex.join(["hf-accum", "train", recipe, *kept, "resume_from_checkpoint=true"])


# --- shared ------------------------------------------------------------------------------------------
def _import_bitsandbytes_only_if(args: argparse.Namespace, quantizing: bool) -> None:
    """In the `hf-accum` process itself (not when `main` is called from Python), keep bitsandbytes out unless the
    command quantizes: transformers and peft import it whenever it is installed, which costs time and, on CPU,
    prints a warning about an optional kernel package. The choice is per process (both cache it)."""
    if args.own_process and not quantizing and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None  # import fails; transformers and peft then treat it as not installed


def _require_recipe_extra() -> None:
    import importlib.util

    missing = [name for name in ("yaml", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"recipes need pyyaml and datasets ({', '.join(missing)} missing): "
                         "pip install pyyaml datasets trl (the recipes extra)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints the usage and exits; one line with the fix instead
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-accum", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hf-accum {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="{probe,train}", parser_class=_Parser)
    _add_probe_parser(sub)
    _add_train_parser(sub)
    for name, p in sub.choices.items():
        # Also after the sub-command; SUPPRESS keeps `hf-accum --debug train` from being reset to False.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback")
        p.set_defaults(parser=p, command=name)
    return parser


def _join_negative_values(raw: list[str]) -> list[str]:
    joined: list[str] = []
    for item in raw:
        previous = joined[-1] if joined else ""
        if re.match(r"-\.?[0-9]", item) and previous.startswith("--") and "=" not in previous and previous != "--":
            joined[-1] = f"{previous}={item}"
        else:
            joined.append(item)
    return joined


def _parse(parser: argparse.ArgumentParser, raw: list[str]) -> argparse.Namespace:
    """As parse_args, but key=value overrides may also follow flags (`train lora_sft --print-config max_steps=3`),
    and a flag's value may start with a minus (`--device-memory -5GiB` reaches the value's own rule instead of
    argparse's "expected one argument")."""
    args, extra = parser.parse_known_args(_join_negative_values(raw))
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    unknown = [item for item in extra if item not in overrides]
    if unknown and vars(args).get("overrides") is not None:  # `train`: a key given as a flag (--max_steps=5)
        keys = _flags_as_overrides(unknown)
        if keys:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}; recipe keys are key=value without dashes: "
                         f"{' '.join(keys)}")
    if unknown or (overrides and vars(args).get("overrides") is None):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def _flags_as_overrides(unknown: list[str]) -> list[str]:
    """``--max_steps=5`` / ``--max_steps 5`` as the overrides they were meant to be (``max_steps=5``); [] when
    ``unknown`` is not only flags with values."""
    keys, items = [], list(unknown)
    while items:
        item = items.pop(0)
        if not re.fullmatch(r"--?[A-Za-z_][\w.]*(=.*)?", item):
            return []
        if "=" not in item:
            if not items or items[0].startswith("-"):
                return []
            item = f"{item}={items.pop(0)}"
        keys.append(item.lstrip("-"))
    return keys


class _WholePaths(argparse.HelpFormatter):
    """Text wrapped at spaces only: the recipe folder's path stays whole where a user copies it (textwrap broke an
    installed one at the hyphen of site-packages)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False, break_long_words=False)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (2: a user error, printed as one line on stderr)."""
    # Kineto (the CPU meter's profiler) reads this when torch loads; it would print stage lines per trial.
    os.environ.setdefault("KINETO_LOG_LEVEL", "3")
    raw = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    command = next((a for a in raw if a in ("probe", "train")), None)
    try:
        args = _parse(parser, raw)
        if vars(args).get("func") is None:
            parser.print_help()
            return 2
        args.own_process = argv is None
        if args.func is _run_train or args.recipe is not None:
            _require_recipe_extra()
        return int(args.func(args) or 0)
    except (UsageError, ValueError) as exc:  # RecipeError, the Trainer's and the probe's refusals are ValueErrors
        if "--debug" in raw:
            raise
        print(f"hf-accum{' ' + command if command else ''}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # start-up (recipes.run.StoppedBeforeTraining), a second Ctrl-C, or elsewhere
        if "--debug" in raw:
            raise
        from .trainer.resilience.output_guard import tell

        said = " ".join(str(exc).split()).removeprefix("hf_accum: ") or "stopped (Ctrl-C)"
        tell(f"hf-accum{' ' + command if command else ''}: {said}")
        return 130  # 128 + SIGINT, as a shell reports a Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
