"""Loading the model a user names: the built-in offline `tiny`, a local directory saved with `save_pretrained`,
or a hub id; optionally with a 4/8-bit base (bitsandbytes). Used by the recipes and by `hf-accum probe`.
Errors say what to do instead."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

TINY = "tiny"


def require_bitsandbytes(what: str, instead: str) -> None:
    """Fail before loading anything when quantization is asked for and bitsandbytes cannot be imported."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"{what} needs bitsandbytes, which is not installed ({exc}): pip install 'hf-accum[qlora]' "
            f"(bitsandbytes >= 0.45; on CPU it runs NF4 training too), or {instead}."
        ) from None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def not_loadable(label: str, name: str, exc: Exception) -> ValueError:
    where = "a local directory" if os.path.isdir(name) else "a hub id"
    reason = (str(exc).splitlines() or [repr(exc)])[0].rstrip(".")
    return ValueError(
        f"{label}={name!r} could not be loaded as {where}: {reason}. Give a directory saved with save_pretrained, "
        f"a hub id reachable from here{' (HF_HUB_OFFLINE is set)' if offline() else ''}, or {TINY} for the "
        "built-in offline model."
    )


def load_model(name: str = TINY, *, task: str = "causal_lm", dtype=None, quantization: dict[str, Any] | None = None,
               device=None, num_labels: int = 2, tokenizer=None, tiny: dict[str, Any] | None = None,
               label: str = "model", **from_pretrained: Any):
    """The base model, quantized when ``quantization`` (BitsAndBytesConfig keywords) is given; not yet peft-wrapped.

    ``task``: "causal_lm" or "seq_cls". ``tiny``: keywords of `hf_accum.tiny.build_model`.
    """
    from transformers import BitsAndBytesConfig

    extra = dict(from_pretrained)
    if quantization is not None:
        target = device if device is not None else (torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
        extra.update(quantization_config=BitsAndBytesConfig(**quantization), device_map={"": target})
    if name != TINY:
        return _from_pretrained(label, name, name, task, dtype, num_labels, tokenizer, **extra)
    from . import tiny as tiny_models

    base = tiny_models.build_model(task, tokenizer=tokenizer, num_labels=num_labels,
                                   dtype=None if dtype == "auto" or quantization else dtype, **(tiny or {}))
    if quantization is None:
        return base if device is None else base.to(device)
    # Quantization happens at load time, so a model built from config goes through save/from_pretrained.
    with tempfile.TemporaryDirectory(prefix="hf_accum_tiny_") as tmp:
        base.save_pretrained(tmp)
        del base
        return _from_pretrained(label, name, tmp, task, dtype, num_labels, tokenizer, **extra)


def _from_pretrained(label, name, source, task, dtype, num_labels, tokenizer, **kwargs):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if offline():
        kwargs.setdefault("local_files_only", True)
    if task == "seq_cls":
        cls = AutoModelForSequenceClassification
        kwargs.update(num_labels=num_labels)
        if tokenizer is not None:
            kwargs["pad_token_id"] = tokenizer.pad_token_id
    else:
        cls = AutoModelForCausalLM
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized: score.weight" warning is expected: LoRA trains it
    try:
        hf_logging.disable_progress_bar()
        return cls.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise not_loadable(label, name, exc) from None
    finally:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)


def add_lora(model, *, r: int = 8, alpha: int | None = None, target_modules: list[str] | None = None,
             quantized: bool = False):
    """LoRA as `hf-accum probe --lora` measures it (the recipes configure theirs from the YAML)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        # peft's k-bit preparation (casts non-quantized weights to float32; the probe measures what that costs).
        # use_gradient_checkpointing=False: the caller decides checkpointing and the input-grad hook with it.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(r=r, lora_alpha=alpha or 2 * r, target_modules=target_modules or "all-linear",
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(model, config)
