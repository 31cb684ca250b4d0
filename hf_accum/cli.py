"""The `hf-accum` console script: `hf-accum probe ...` and `hf-accum train ...`.

Each sub-command owns one `_add_<name>_parser` function (its flags) and one `_run_<name>` function;
`main` only dispatches, so heavy imports (torch, transformers) happen after argument errors are reported.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__

# --- probe -------------------------------------------------------------------------------------------
# The offline default must exercise the search: 24 MiB is below what micro-batch 32 of the tiny model needs at
# seq 256 on CPU, so the plan needs accumulation > 1.
DEFAULT_PROBE_BUDGET_BYTES = 24 * 2**20


def _add_probe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe", help="measure peak memory per micro-batch and print the plan",
        description="Measure the peak memory of real training steps at increasing micro-batch sizes and plan "
                    "micro-batch x accumulation x world = target.",
    )
    p.add_argument("--model", default="tiny", help="hub id, local directory (save_pretrained), or 'tiny' (offline)")
    p.add_argument("--seq-len", type=int, default=256, help="sequence length to measure at (default 256)")
    p.add_argument("--target-batch", type=int, default=32, help="effective batch: samples per optimizer step")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks the plan is for")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of all weights")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-target-modules", default=None, help="comma-separated module names (default all-linear)")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--load-in-4bit", action="store_true", help="NF4 base weights (bitsandbytes)")
    q.add_argument("--load-in-8bit", action="store_true", help="LLM.int8 base weights (bitsandbytes, CUDA)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=None,
                   help="causal-LM loss without the full logits, as training will use it (default: on where "
                        "supported; --fused-loss: required, --no-fused-loss: off)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--budget", type=float, default=None, help="fraction (0, 1] of the device's memory")
    b.add_argument("--budget-bytes", type=int, default=None,
                   help=f"budget in bytes (default for the tiny model: {DEFAULT_PROBE_BUDGET_BYTES}; otherwise 0.9 "
                        "of the device)")
    p.add_argument("--max-micro-batch", type=int, default=None, help="largest micro-batch to try")
    p.add_argument("--optimize", choices=["memory", "throughput"], default="memory")
    p.add_argument("--json", default=None, help="write the measurements and plan to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG of the memory curve to this file")
    p.set_defaults(func=_run_probe)


def _check_probe_args(args: argparse.Namespace) -> None:
    for name in ("seq_len", "target_batch", "world_size", "lora_r", "max_micro_batch", "budget_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"hf-accum probe: --{name.replace('_', '-')}={value} must be a positive integer")
    if args.budget is not None and not 0 < args.budget <= 1:
        raise SystemExit(f"hf-accum probe: --budget={args.budget} must be a fraction in (0, 1]; "
                         "for an absolute budget use --budget-bytes")
    if args.target_batch % args.world_size:
        from .plan import nearest_exact_targets

        options = " or ".join(map(str, nearest_exact_targets(args.target_batch, args.world_size)))
        raise SystemExit(f"hf-accum probe: --target-batch={args.target_batch} is not divisible by "
                         f"--world-size={args.world_size}; use --target-batch {options}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("hf-accum probe: --plot needs matplotlib: pip install 'hf-accum[plot]'") from None


def _run_probe(args: argparse.Namespace) -> int:
    _check_probe_args(args)  # before any model is loaded
    import torch

    from .loading import add_lora, load_model, require_bitsandbytes
    from .probe import NothingFitsError, probe_model
    from .probe_report import summary, table, write_json, write_plot

    quantization = None
    try:
        if args.load_in_4bit or args.load_in_8bit:
            require_bitsandbytes("--load-in-4bit/--load-in-8bit", "probe without quantization")
            if args.load_in_8bit and not torch.cuda.is_available():
                raise ValueError("8-bit (LLM.int8) training needs a CUDA GPU; on CPU use --load-in-4bit (NF4) or neither")
            quantization = (
                {"load_in_8bit": True} if args.load_in_8bit else
                {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                 "bnb_4bit_compute_dtype": torch.bfloat16 if args.bf16 else torch.float32}
            )
        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"loading {args.model} on {device} ...", flush=True)
        model = load_model(args.model, quantization=quantization, device=device)
    except ValueError as exc:
        raise SystemExit(f"hf-accum probe: {exc}") from None
    quantized = args.load_in_4bit or args.load_in_8bit
    if args.lora or quantized:
        targets = args.lora_target_modules.split(",") if args.lora_target_modules else None
        model = add_lora(model, r=args.lora_r, target_modules=targets, quantized=quantized)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    from .fused_loss import patch_model, resolve_for_model

    try:
        fused, why = resolve_for_model(model, args.fused_loss, ("--fused-loss", "--no-fused-loss"))
    except ValueError as exc:
        raise SystemExit(f"hf-accum probe: {exc}") from None
    print(f"fused loss: {'on' if fused else 'off'} ({why})", flush=True)
    if fused:
        patch_model(model)  # for the probe's training steps; the process ends after the probe
    budget_bytes = args.budget_bytes
    if budget_bytes is None and args.budget is None and args.model == "tiny":
        budget_bytes = DEFAULT_PROBE_BUDGET_BYTES
    try:
        result, plan = probe_model(
            model, seq_len=args.seq_len, target_batch_size=args.target_batch, world_size=args.world_size,
            budget_bytes=budget_bytes, budget_fraction=args.budget,
            autocast_dtype=torch.bfloat16 if args.bf16 else None, max_micro_batch=args.max_micro_batch,
            optimize=args.optimize, log=lambda msg: print(f"  {msg}", flush=True),
        )
    except NothingFitsError as exc:
        print(table(exc.result, args.seq_len))
        raise SystemExit(f"hf-accum probe: {exc}") from None
    except ValueError as exc:
        raise SystemExit(f"hf-accum probe: {exc}") from None
    print()
    print(table(result, args.seq_len))
    print()
    print(summary(result, plan, args.seq_len))
    if args.json:
        write_json(args.json, result, plan, args.seq_len)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, result, plan)
        print(f"wrote {args.plot}")
    return 0


# --- train -------------------------------------------------------------------------------------------
def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="run a recipe (a name from recipes/ or a YAML path) with key=value overrides",
        description="Run a LoRA / QLoRA recipe: probe memory, plan micro-batch x accumulation x world = "
                    "target_batch_size, train, save the adapter and run_summary.json in output_dir.",
        epilog="Overrides: section.key=value (model.dtype=bfloat16, lora.r=32, training.learning_rate=1e-4), a bare "
               "key when one section has it (max_steps=100), model=HUB_ID_OR_DIR, dataset=HUB_ID_OR_FILE. Values "
               "are YAML scalars. Recipes: lora_sft, qlora_sft, lora_classification (see recipes/*.yaml).",
    )
    p.add_argument("recipe", help="recipe name (e.g. lora_sft) or path of a recipe YAML file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides of recipe keys")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved recipe (after overrides) and exit without training")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    try:
        from .recipes import RecipeError, format_recipe, load_recipe, run_recipe
    except ImportError as exc:  # pyyaml / datasets live in the `recipes` extra
        raise SystemExit(
            f"hf-accum train: {exc}; install the recipe dependencies: pip install 'hf-accum[recipes]'"
        ) from None
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if args.print_config:
            print(format_recipe(recipe), end="")
            return 0
        run_recipe(recipe)
    except RecipeError as exc:  # a key or value of the recipe: the message says what to set
        raise SystemExit(f"hf-accum train: {exc}") from None
    return 0


# --- dispatch ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-accum", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hf-accum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{probe,train}")
    _add_probe_parser(sub)
    _add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Kineto (the CPU meter's profiler) reads this when torch loads; it would print stage lines per trial.
    os.environ.setdefault("KINETO_LOG_LEVEL", "3")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
