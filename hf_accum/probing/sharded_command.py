"""`hf-accum probe --estimate --gpus 1,2,4,8 --sharding ...`: the command over `paper_sharded.sharded_grid`."""

from __future__ import annotations

from typing import Any

from .paper_sharded import sharded_grid


def run(args: Any, say=print) -> int:
    """`hf-accum probe --estimate --gpus 1,2,4,8 [--sharding fsdp2]`: one table per card size."""
    import time

    from . import paper
    from .cards import card_name
    from .fits import _check_lengths, parse_list
    from .meters import format_bytes
    from .sharding import rank_bytes

    if args.device_memory is None:
        raise ValueError("--gpus: give the card's memory, --device-memory 80GiB (or a list, 24GiB,48GiB,80GiB)")
    cards = parse_list(args.device_memory, paper.parse_size, "--device-memory")
    gpus = parse_list(args.gpus or "1", _gpu_count, "--gpus")
    seq_lens = args.seq_len if isinstance(args.seq_len, list) else [args.seq_len]
    device = args.device or "cuda"
    quantization = "nf4" if args.load_in_4bit else "int8" if args.load_in_8bit else None
    lora_r = args.lora_r if args.lora or quantization else None
    config = paper.load_config(args.model)
    _check_lengths(config, seq_lens)  # before any step: a length the model cannot take is one line
    build = paper.builder(paper.config_builder(config), lora_r, args.lora_target_modules, args.fused_loss)
    say(f"estimating {args.model} sharded ({args.sharding or 'fsdp2'}) on {', '.join(map(str, gpus))} GPUs of "
        f"{', '.join(card_name(c) for c in cards)} (fake tensors: nothing loaded; weights "
        f"{paper.weights_dtype(config)}) ...")
    start = time.monotonic()
    import torch

    est = sharded_grid(build, seq_lens=seq_lens, cards=cards, gpus=gpus, sharding=args.sharding or "fsdp2",
                       target_batch_size=args.target_batch, device=device, bf16=args.bf16,
                       fraction=args.budget or 0.9, max_micro_batch=args.max_micro_batch, quantization=quantization,
                       quantization_options={"compute_dtype": torch.bfloat16 if args.bf16 else torch.float32,
                                             "double_quant": False},
                       log=lambda msg: say(f"  {msg}"))
    say("")
    say(est.table())
    say("")
    say(f"N: the largest micro-batch per rank (N+: the cap, --target-batch {args.target_batch} over the ranks); "
        "then the plan, micro × accumulation × world = target (the fewest forwards, near-equal). Does not fit: the "
        "fewest GPUs of that card that would.")
    for w in gpus:
        rb = rank_bytes(est.counts, est.sharding, w)
        say(f"per rank at {w} GPU{'s' if w > 1 else ''}: weights {format_bytes(rb.weights)}, gradients "
            f"{format_bytes(rb.gradients)}, optimizer {format_bytes(rb.optimizer)}, gathered "
            f"{format_bytes(rb.gathered)}, gradient buffers {format_bytes(rb.gradient_buffers)}"
            + (f", optimizer step {format_bytes(rb.optimizer_step)}" if rb.optimizer_step else "")
            + (f", on CPU {format_bytes(rb.cpu)}" if rb.cpu else ""))
    paper.say_assumed(est, say)
    say(f"({time.monotonic() - start:.0f} s)")
    return paper.write_json(args, est, say)


def _gpu_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--gpus: {text!r} is not a number of GPUs; give e.g. --gpus 1,2,4,8")
    return value
