"""Building the model a user names, for the recipes and `hf-accum probe` alike: the built-in offline `tiny`, a
local directory saved with `save_pretrained`, or a hub id; optionally with a 4/8-bit base (bitsandbytes); then the
one LoRA preparation (:func:`add_lora`). Errors say what to do instead."""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any
from urllib.parse import urlparse

TINY = "tiny"
KBIT_PREPARATIONS = ("light", "peft")
HUB_TIMEOUT_S = 3.0


def require_bitsandbytes(what: str, instead: str) -> None:
    """Fail before loading anything when quantization is asked for and bitsandbytes cannot be imported."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"{what} needs bitsandbytes, which is not installed ({exc}): pip install 'bitsandbytes>=0.45' "
            f"(the qlora extra; on CPU it runs NF4 training too), or {instead}."
        ) from None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


# A name that starts like this is a path, never a hub id (hub ids are "name" or "org/name").
PATH_STARTS = ("./", "../", "/", "~", ".\\", "..\\")


def missing_path(label: str, name: str, kind: str = "model") -> str | None:
    """The one-line error when ``name`` is written as a path (``./x``, ``../x``, ``/x``, ``~/x``) and nothing is
    there; None otherwise. Without it the name would be taken for a hub id and refused in the hub's words."""
    if not isinstance(name, str) or not (name.startswith(PATH_STARTS) or name in (".", "..")):
        return None
    if os.path.exists(os.path.expanduser(name)):
        return None
    what = "directory" if kind == "model" else "file or directory"
    saved = "the directory a model was saved to with save_pretrained" if kind == "model" else f"an existing {kind}"
    return f"{label}={name!r} is a path, but there is no such {what}: give {saved}, or a hub id (org/name)"


def hub_unreachable(label: str, name: str, kind: str = "model") -> ValueError | None:
    """None when ``name`` needs no hub (a local path, HF_HUB_OFFLINE set) or the hub answers within a few seconds;
    otherwise the error to raise. huggingface_hub retries an unreachable hub for about a minute before failing.
    A name written as a path that does not exist is that error, hub or no hub."""
    missing = missing_path(label, name, kind)
    if missing:
        return ValueError(missing + ".")
    if offline() or os.path.exists(name):
        return None
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") if endpoint.scheme == "https" else (
        os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy"))
    target = urlparse(proxy) if proxy else endpoint
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((target.hostname, port), timeout=HUB_TIMEOUT_S).close()
        return None
    except OSError as exc:
        return ValueError(
            f"{label}={name!r} is not a local path, so it is a hub id, but the hub ({endpoint.geturl()}) is not "
            f"reachable from here ({exc}). Set HF_HUB_OFFLINE=1 to use the {kind}s in the local cache, or give a "
            f"local directory{' saved with save_pretrained' if kind == 'model' else ' or file'}."
        )


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
    import torch
    from transformers import BitsAndBytesConfig

    extra = dict(from_pretrained)
    if quantization is not None:
        target = device if device is not None else (torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
        extra.update(quantization_config=BitsAndBytesConfig(**quantization), device_map={"": target})
    if name != TINY:
        unreachable = hub_unreachable(label, name)
        if unreachable is not None:
            raise unreachable
        return _unpacked(_from_pretrained(label, name, name, task, dtype, num_labels, tokenizer, **extra))
    from .. import tiny as tiny_models

    base = tiny_models.build_model(task, tokenizer=tokenizer, num_labels=num_labels,
                                   dtype=None if dtype == "auto" or quantization else dtype, **(tiny or {}))
    if quantization is None:
        return base if device is None else base.to(device)
    # Quantization happens at load time, so a model built from config goes through save/from_pretrained.
    with tempfile.TemporaryDirectory(prefix="hf_accum_tiny_") as tmp:
        base.save_pretrained(tmp)
        del base
        model = _from_pretrained(label, name, tmp, task, dtype, num_labels, tokenizer, **extra)
    # Named "tiny", not after the temporary directory: peft records the name in the adapter config, and the plan key
    # holds that, so a random name would make every run probe again.
    model.name_or_path = model.config._name_or_path = TINY
    return _unpacked(model)


def _unpacked(model):
    """A quantized base as hf_accum trains it, and as a trained one reloaded computes what it computed in training:
    its 4-bit layers never switch to bitsandbytes' CPU inference layout (`compat.bitsandbytes_cpu`)."""
    from ..compat import bitsandbytes_cpu

    bitsandbytes_cpu.keep_unpacked(model)
    return model


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


def add_lora(model, lora_config, *, quantized: bool = False, kbit_preparation: str = "light",
             checkpointing: bool = False):
    """The one LoRA preparation, for `hf-accum train` and `hf-accum probe` alike: k-bit preparation of a quantized
    base, input gradients for checkpointing, then `get_peft_model`. Checkpointing itself is switched on where
    training switches it on (the Trainer, and `levers.checkpointing.enable_checkpointing` before a probe).

    ``kbit_preparation`` (quantized bases): "light" leaves the non-quantized weights in their dtype (get_peft_model
    freezes the base); "peft" runs `peft.prepare_model_for_kbit_training`, which also upcasts them to float32.
    """
    from peft import get_peft_model, prepare_model_for_kbit_training

    if kbit_preparation not in KBIT_PREPARATIONS:
        raise ValueError(f"kbit_preparation={kbit_preparation!r} must be one of {list(KBIT_PREPARATIONS)}")
    if quantized and kbit_preparation == "peft":
        # Checkpointing off here: it is switched on in one place (see above), with the run's own kwargs.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if checkpointing:
        # The embeddings' output requires grad, so any checkpointed segment has an input that needs a gradient.
        model.enable_input_require_grads()
    from ..compat.gradient_checkpointing import peft_reads_quietly

    with peft_reads_quietly():
        return get_peft_model(model, lora_config)
