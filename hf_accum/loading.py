"""Loading the model a user names: the built-in offline `tiny`, a local directory saved with `save_pretrained`,
or a hub id; with optional 4/8-bit quantization (bitsandbytes) and LoRA (peft). Errors say what to do."""

from __future__ import annotations

import os

import torch

TINY = "tiny"


def check_quantization(load_in_4bit: bool, load_in_8bit: bool) -> None:
    """Fail before loading anything when the quantization request cannot run here."""
    if load_in_4bit and load_in_8bit:
        raise ValueError("choose one of --load-in-4bit / --load-in-8bit, not both")
    if not (load_in_4bit or load_in_8bit):
        return
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ValueError(
            "4/8-bit loading needs bitsandbytes, which is not installed: pip install 'hf-accum[qlora]'"
        ) from None
    if load_in_8bit and not torch.cuda.is_available():
        raise ValueError("8-bit (LLM.int8) training needs a CUDA GPU; on CPU use --load-in-4bit (NF4) or neither")


def load_causal_lm(name: str = TINY, *, load_in_4bit: bool = False, load_in_8bit: bool = False,
                   dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """The model and its tokenizer (None where it has none)."""
    check_quantization(load_in_4bit, load_in_8bit)
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quant = None
    if load_in_4bit or load_in_8bit:
        compute = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
        quant = BitsAndBytesConfig(load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
                                   bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute)
    if name == TINY:
        from . import tiny

        tokenizer = tiny.build_tokenizer()
        model = tiny.build_model(tokenizer=tokenizer, dtype=dtype)
        if quant is None:
            return model.to(device or "cpu"), tokenizer
        import tempfile

        # Quantization happens at load time, so the tiny model goes through save_pretrained/from_pretrained.
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=quant, device_map=_map(device))
        return model, tokenizer
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    try:
        model = AutoModelForCausalLM.from_pretrained(name, quantization_config=quant, dtype=dtype,
                                                     device_map=_map(device) if quant else None,
                                                     local_files_only=offline)
    except OSError as exc:
        where = "a local directory" if os.path.isdir(name) else "a hub id"
        raise ValueError(
            f"could not load model {name!r} as {where}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}. "
            f"Pass a directory saved with save_pretrained, a hub id reachable from here (the hub is "
            f"{'off: HF_HUB_OFFLINE=1' if offline else 'consulted'}), or '{TINY}' for the built-in offline model."
        ) from None
    if quant is None and device is not None:
        model = model.to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def _map(device) -> dict | None:
    return {"": str(device)} if device is not None else None


def add_lora(model, *, r: int = 8, alpha: int | None = None, target_modules: list[str] | None = None,
             quantized: bool = False):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        # peft's k-bit preparation (casts non-quantized weights to float32; the probe measures what that costs).
        # use_gradient_checkpointing=False: the caller decides checkpointing and the input-grad hook with it.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=target_modules or "all-linear",
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(model, config)
