"""What `hf-accum probe --model M` measures: the model loaded as the flags ask (quantized, LoRA, checkpointing) and
the checkpointing lever `--checkpoint-layers` gives the probe. A bad flag is a ValueError (one line from the CLI)."""

from __future__ import annotations

from typing import Any


def bare_model(args: Any):
    """The bare model `hf-accum probe MODEL` measures: loaded (quantized if asked), LoRA, checkpointing."""
    import torch

    from .loading import add_lora, load_model, require_bitsandbytes

    quantization = None
    if args.load_in_4bit or args.load_in_8bit:
        require_bitsandbytes("--load-in-4bit/--load-in-8bit", "probe without quantization")
        if args.load_in_8bit and not torch.cuda.is_available():
            raise ValueError("--load-in-8bit: 8-bit (LLM.int8) training needs a CUDA GPU; on CPU use --load-in-4bit "
                             "(NF4) or neither")
        quantization = (
            {"load_in_8bit": True} if args.load_in_8bit else
            {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
             "bnb_4bit_compute_dtype": torch.bfloat16 if args.bf16 else torch.float32}
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"loading {args.model} on {device} ...", flush=True)
    model = load_model(args.model, quantization=quantization, device=device)
    quantized = quantization is not None
    if args.lora or quantized:
        from peft import LoraConfig

        targets = args.lora_target_modules.split(",") if args.lora_target_modules else "all-linear"
        lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=targets, lora_dropout=0.0,
                          task_type="CAUSAL_LM")
        model = add_lora(model, lora, quantized=quantized, kbit_preparation=args.kbit_preparation,
                         checkpointing=args.gradient_checkpointing)
    if args.gradient_checkpointing:
        from types import SimpleNamespace

        from ..levers.checkpointing import enable_checkpointing

        # Switched on as training switches it on (the one helper the tuner uses too), LoRA-safe kind.
        enable_checkpointing(model, SimpleNamespace(gradient_checkpointing=True,
                                                    gradient_checkpointing_kwargs={"use_reentrant": False}))
    return model


def checkpoint_lever(args: Any, model):
    """--checkpoint-layers: the lever the probe chooses k with ("auto"), or exactly K layers set now."""
    from ..compat import gradient_checkpointing
    from ..levers.checkpointing import Levels, check_layers, parse_layers

    if args.checkpoint_layers is None:
        return None
    levels = gradient_checkpointing.checkpoint_levels(model)
    kwargs = {"use_reentrant": False}  # the LoRA-safe kind, as --gradient-checkpointing
    try:
        want = parse_layers(args.checkpoint_layers, "--checkpoint-layers")
        if want == "auto":
            return Levels(model, levels, kwargs) if levels else None
        check_layers(want, levels, type(model).__name__, True, f"--checkpoint-layers {want}")
    except ValueError:
        raise ValueError(f"--checkpoint-layers {args.checkpoint_layers}: give 'auto' or an integer 0..{levels} "
                         f"({type(model).__name__} has {levels} checkpointable layers)") from None
    gradient_checkpointing.set_checkpointed_layers(model, want, kwargs)
    return None
