"""A causal-LM training loss that never materializes the logits, equal to transformers' `ForCausalLMLoss`.

For a causal LM the (tokens, vocab) logits, their float32 copy and their gradient are most of a step's activation
memory at realistic vocabularies. Here the loss is computed from the last hidden states and the LM head's weight in
row chunks:

    loss = sum over counted targets t of cross_entropy(h_t @ W.T + b, y_t) / num_items_in_batch

with the causal shift (or pre-shifted ``shift_labels`` as padding-free collators give them), -100 ignored, and
the micro-batch's own count when ``num_items_in_batch`` is not passed -- what `ForCausalLMLoss` returns, with the
same gradient. hf_accum's window scaling (loss.py) then applies unchanged.

How it is installed: `patch_model` wraps the forward of the model's `PreTrainedModel` that owns the output
embeddings (peft models and users' wrappers are seen through). The wrapper is active only while that module is in
training mode and is called with labels; evaluation, generation and any call without labels run the original forward
and get their logits. When active it runs the original forward without the labels and with the LM head stubbed to
record its input, so every architecture's backbone runs as written. What the stub would hide -- an adapter on the
head, softcapping, logit scaling, extra loss terms (MoE router loss) -- is refused by `unsupported_reason`, which
checks the head's type and the config and verifies one tiny forward: the model's logits must be its head's output and
its loss the plain cross-entropy of those logits.

Kernels (hf_accum/levers/kernels/, one seam): torch's chunked `F.linear_cross_entropy` (torch >= 2.13, float32/float64),
our checkpointed chunks (everywhere), Liger's and Cut Cross-Entropy's (CUDA, their packages). Before a measurement
the first that runs on the device and dtype computes the loss; the probe times each that runs and the plan takes the
fastest that fits (`FusedLossPatch.kernel`, set by the ``loss_kernel`` lever from the plan or a pin).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from ...compat import bitsandbytes_cpu, deepspeed_integration, torch_features
from ...config.settings import Settings
from ...window.loss import IGNORE_INDEX, loss_shifts_labels
from .. import kernels
from . import chunked

logger = logging.getLogger(__name__)

# "auto": the patch's kernel (the plan's or a pin) or the default for the device and dtype; a kernel's name forces
# it (tests force "chunked" to cover the path older torch takes).
IMPLEMENTATION = "auto"

# Config fields with which the model post-processes the logits (as TRL's add_fused_lm_head reads them).
_SOFTCAPPING = ("final_logit_softcapping",)
_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


# --- the loss -----------------------------------------------------------------------------------------------------
# The kernels (hf_accum/levers/kernels/) compute it; these names stay here for the callers and benchmarks that read them.
chunk_rows = chunked.chunk_rows
ACCELERATOR_LOGITS_PER_CHUNK = chunked.ACCELERATOR_LOGITS_PER_CHUNK


def implementation_for(hidden: torch.Tensor, weight: torch.Tensor, kernel: str | None = None) -> str:
    """The kernel that computes the loss of ``hidden`` through ``weight``: ``IMPLEMENTATION`` when forced, else the
    plan's or the user's (``kernel``), else the default for the device and dtype (`kernels.default`)."""
    if IMPLEMENTATION != "auto":
        return IMPLEMENTATION
    autocast = torch_features.is_autocast_enabled(hidden.device.type) or hidden.dtype != weight.dtype
    if kernel is not None:
        why = kernels.unavailable(kernel, hidden.device.type, hidden.dtype, autocast)
        if why is not None:
            raise RuntimeError(f"hf_accum fused loss: loss kernel {kernel!r} cannot run here: {why}. Pin another "
                               "(levers=\"loss_kernel=chunked\") or set fused_loss=False.")
        return kernel
    return kernels.default(hidden.device.type, hidden.dtype, autocast)


def token_loss_sum(hidden, weight, bias, targets, kernel: str | None = None, paper: bool = False):
    """Sum of cross_entropy(hidden @ weight.T + bias, targets) over rows that all count; ``hidden`` (rows,
    hidden_size)."""
    name = kernel if paper and kernel else implementation_for(hidden, weight, kernel)  # on paper: the estimate's pick
    return kernels.token_loss(name, hidden, weight, bias, targets, counted=True, paper=paper)[0]


def causal_lm_loss(hidden, weight, bias=None, labels=None, shift_labels=None, num_items_in_batch=None, kernel=None,
                   paper=False):
    """`ForCausalLMLoss` from the hidden states entering the LM head (batch, seq, hidden) instead of the logits."""
    if shift_labels is None:
        hidden, targets = hidden[..., :-1, :], labels[..., 1:]
    else:
        targets = shift_labels
    if targets.shape != hidden.shape[:-1]:
        raise RuntimeError(
            f"hf_accum fused loss: labels of shape {tuple(targets.shape)} do not match the LM head's input "
            f"{tuple(hidden.shape)}; set fused_loss=False and report this model."
        )
    hidden = hidden.reshape(-1, hidden.shape[-1]).to(weight.device)
    targets = targets.reshape(-1).to(hidden.device, torch.long)
    keep = targets != IGNORE_INDEX  # only counted rows reach the head: prompt and padding cost nothing
    total = token_loss_sum(hidden[keep], weight, bias, targets[keep], kernel=kernel, paper=paper)
    count = keep.sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(total.device)
    return total / count


# --- the model patch ----------------------------------------------------------------------------------------------
def causal_lm_module(model: nn.Module):
    """The `PreTrainedModel` inside ``model`` whose forward computes the LM loss (owns the output embeddings)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            try:
                head = module.get_output_embeddings()
            except (AttributeError, NotImplementedError):
                head = None
            return module if head is not None else None
    return None


class FusedLossPatch:
    """Handle of an installed patch; `remove()` (or leaving `fused_lm_loss`) makes the model's forward the original
    again. If something wrapped the patched forward meanwhile (accelerate's autocast wrapper does, under mixed
    precision), the patch stays in that chain but is inert."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.active = True
        self.kernel: str | None = None  # the plan's or the user's loss kernel (the loss_kernel lever sets it)
        self.paper = False  # the estimate's fake step: the kernel's memory model stands in (kernels/paper.py)
        self.original = model.forward
        self.previous = model.__dict__.get("forward")
        patch = self

        @functools.wraps(self.original)  # keeps the signature: Trainer reads it (loss kwargs, unused columns)
        def forward(*args, **kwargs):
            if patch.active and model.training and _fusable(args, kwargs):
                return patch._fused(args, kwargs)
            return patch.original(*args, **kwargs)

        forward._hf_accum_fused_loss = self
        self.forward = forward
        model.forward = forward

    def _fused(self, args, kwargs):
        labels = kwargs.pop("labels", None)
        shift_labels = kwargs.pop("shift_labels", None)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        head = self.model.get_output_embeddings()
        captured = []

        def record(hidden):
            captured.append(hidden)
            return hidden.new_empty(*hidden.shape[:-1], 0)

        own = head.__dict__.get("forward")  # e.g. accelerate's device hooks
        head.forward = record
        try:
            out = self.original(*args, **kwargs)
        finally:
            if own is None:
                del head.forward
            else:
                head.forward = own
        if len(captured) != 1:
            raise RuntimeError(
                f"hf_accum fused loss: {type(self.model).__name__}'s forward called its LM head {len(captured)} times "
                "(expected once); set fused_loss=False and report this model."
            )
        loss = causal_lm_loss(captured[0], head.weight, head.bias, labels, shift_labels, num_items_in_batch,
                              kernel=self.kernel, paper=self.paper)
        if isinstance(out, tuple):  # return_dict=False: (logits, ...) -> (loss, ...)
            return (loss, *out[1:])
        return type(out)(**{**{k: v for k, v in out.items() if k != "logits"}, "loss": loss})

    def remove(self) -> None:
        self.active = False
        if self.model.__dict__.get("forward") is self.forward:
            if self.previous is None:
                del self.model.forward
            else:
                self.model.forward = self.previous


def _fusable(args, kwargs) -> bool:
    if kwargs.get("labels") is None and kwargs.get("shift_labels") is None:
        return False
    # Positional arguments past input_ids or a logits slice would change what the head sees: run the original.
    return len(args) <= 1 and not kwargs.get("logits_to_keep")


def patch_model(model: nn.Module) -> FusedLossPatch | None:
    """Install the fused loss on ``model``'s causal LM (see the module docstring); None if already installed."""
    inner = causal_lm_module(model)
    if inner is None:
        raise ValueError(f"{type(model).__name__} holds no transformers causal LM with output embeddings")
    existing = getattr(inner.__dict__.get("forward"), "_hf_accum_fused_loss", None)
    if existing is not None and existing.active:
        return None
    return FusedLossPatch(inner)


@contextlib.contextmanager
def fused_lm_loss(model: nn.Module):
    """``with fused_lm_loss(model):`` training-mode calls with labels use the fused loss (check
    `unsupported_reason(model)` first)."""
    patch = patch_model(model)
    try:
        yield
    finally:
        if patch is not None:
            patch.remove()


# --- what is supported ----------------------------------------------------------------------------------------------
def unsupported_reason(model: nn.Module, verify: bool = True) -> str | None:
    """Why the fused loss cannot reproduce ``model``'s training loss exactly, or None when it can. ``verify=False``
    (the estimate, whose model has no weights): the head and the config only, not the tiny forward."""
    inner = causal_lm_module(model)
    if inner is None or not loss_shifts_labels(model):
        return f"{type(model).__name__} is not a causal language model"
    head = inner.get_output_embeddings()
    if type(head) is not nn.Linear:
        return (
            f"its LM head is a {type(head).__module__}.{type(head).__name__}, not a plain torch.nn.Linear (a LoRA "
            "adapter, modules_to_save copy or quantized layer on lm_head): the fused loss reads the head's weight "
            "and would leave an adapter there untrained. Keep lm_head out of the adapter's target_modules / "
            "modules_to_save"
        )
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    for name in _SOFTCAPPING:
        if getattr(config, name, None):
            return f"config.{name}={getattr(config, name)} softcaps the logits, which the fused loss does not reproduce"
    for name in _SCALES:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            return f"config.{name}={value} scales the logits, which the fused loss does not reproduce"
    return _verify_forward(inner, head) if verify else None


def _verify_forward(inner, head) -> str | None:
    """One 8-token forward in eval mode: the logits must be the head's output, the loss their plain cross-entropy.
    Catches post-processing and extra loss terms that no config field names."""
    seen = []
    hook = head.register_forward_hook(lambda module, inputs, output: seen.append(output))
    was_training = inner.training
    embeddings = inner.get_input_embeddings()
    device = embeddings.weight.device if embeddings is not None else head.weight.device
    ids = (torch.arange(8, device=device) * 7 + 1).remainder(head.weight.shape[0]).unsqueeze(0)
    bitsandbytes_cpu.keep_unpacked(inner)  # this eval-mode forward must not switch 4-bit layers to inference packing
    try:
        inner.eval()
        with torch.no_grad():
            out = inner(input_ids=ids, labels=ids, use_cache=False)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot verify", reported as the reason
        return f"its forward could not be verified on a tiny input ({type(exc).__name__}: {exc})"
    finally:
        hook.remove()
        inner.train(was_training)
    logits = out["logits"] if isinstance(out, dict) else out[1]
    loss = out["loss"] if isinstance(out, dict) else out[0]
    if len(seen) != 1 or not torch.equal(seen[0].to(logits.dtype), logits):
        return "its forward post-processes the LM head's output (the logits are not the head's output)"
    plain = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:].to(logits.device))
    if loss is None or not torch.allclose(loss.float(), plain, rtol=1e-5, atol=1e-6):
        return "its loss is not the plain cross-entropy of its logits (e.g. an MoE router loss or a custom loss_function)"
    return None


def _trainer_reason(trainer) -> str | None:
    from transformers import Trainer

    if Settings(trainer.args).label_smoothing_factor > 0:
        return (f"label_smoothing_factor={trainer.args.label_smoothing_factor}: transformers' label smoother "
                "computes the loss from the full logits")
    if getattr(trainer, "is_fsdp_enabled", False) or deepspeed_integration.deepspeed_zero3_enabled():
        # The fused loss reads lm_head.weight outside the head's forward, where these keep it sharded.
        return "FSDP / DeepSpeed ZeRO-3 shard the LM head's weight outside its forward"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "compute_loss_func is set: it receives the model's outputs and reads their logits"
    allowed = (Trainer, *getattr(trainer, "_fused_compute_loss_classes", ()))
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in vars(c))
    if owner not in allowed:
        return f"{owner.__name__}.compute_loss overrides Trainer.compute_loss and may read outputs.logits"
    return None


def resolve_fused_loss(trainer) -> tuple[bool, str]:
    """Whether training uses the fused loss, and why. ``args.fused_loss``: None -> on where supported; True -> a
    ValueError naming the reason where unsupported; False -> off."""
    setting = Settings(trainer.args).fused_loss
    by_trainer = getattr(trainer, "_lm_head_fused_by", None)  # e.g. TRL's SFTTrainer fuses its head itself
    if setting is False:
        return False, "fused_loss=False" + (f": {by_trainer} turned off" if by_trainer else "")
    reason = _trainer_reason(trainer)
    if reason is None and by_trainer is not None:
        return True, by_trainer
    return _decide(setting, reason or unsupported_reason(trainer.model))


def resolve_for_model(model: nn.Module, setting: bool | None, flags=("fused_loss=True", "fused_loss=False")):
    """`resolve_fused_loss` for a bare model (hf-accum probe): the same answer, the same error for True."""
    if setting is False:
        return False, flags[1]
    return _decide(setting, unsupported_reason(model), flags)


def _decide(setting, reason, flags=("fused_loss=True", "fused_loss=False")) -> tuple[bool, str]:
    if reason is None:
        return True, f"chunked cross-entropy from the hidden states ({_describe_implementation()})"
    if setting:
        raise ValueError(
            f"{flags[0]}, but {reason}. Set {flags[1]} to train with the full logits, or leave it unset to turn it "
            "off automatically where unsupported."
        )
    return False, reason


def _describe_implementation() -> str:
    if IMPLEMENTATION != "auto":
        return IMPLEMENTATION
    if torch_features.HAS_LINEAR_CROSS_ENTROPY:
        return ("loss kernel torch (F.linear_cross_entropy) for float32/64, chunked for bf16/fp16, or the probe's "
                "fastest")
    return "loss kernel chunked (this torch has no linear_cross_entropy)"


def loss_path(trainer) -> str | None:
    """The loss path in words where the ``loss_kernel`` lever's record does not name it: a trainer that fuses its
    own LM head (TRL's SFTTrainer), or ``use_liger_kernel=True`` with the fused loss off. None otherwise (the
    plan line names the kernel through the lever, or the loss is the model's own as always)."""
    by = getattr(trainer, "_lm_head_fused_by", None)
    liger = "; Liger's other kernels (use_liger_kernel=True)" if trainer.args.use_liger_kernel else ""
    if by is not None and getattr(trainer, "fused_loss_active", False):
        return f"loss by {by}{liger}"
    if liger and not getattr(trainer, "fused_loss_active", False):
        return f"loss from the full logits (fused loss off){liger}"
    return None


def installed_patch(model: nn.Module) -> FusedLossPatch | None:
    """The active fused-loss patch on ``model``'s causal LM, None when there is none."""
    inner = causal_lm_module(model)
    patch = None if inner is None else getattr(inner.__dict__.get("forward"), "_hf_accum_fused_loss", None)
    return patch if patch is not None and patch.active else None


@contextlib.contextmanager
def fused_loss_for(trainer):
    """Training (and the probe) of ``trainer`` with the fused loss where `resolve_fused_loss` says so; one log line.
    Re-entrant: `train()` calling `tune()` resolves once."""
    depth = getattr(trainer, "_fused_loss_depth", 0)
    if depth:
        trainer._fused_loss_depth = depth + 1
        try:
            yield trainer.fused_loss_active
        finally:
            trainer._fused_loss_depth -= 1
        return
    on, reason = resolve_fused_loss(trainer)
    logger.info("hf_accum: fused causal-LM loss %s (%s)", "on" if on else "off", reason)
    trainer.fused_loss_active = on
    patch = patch_model(trainer.model) if on and not getattr(trainer, "_lm_head_fused_by", None) else None
    trainer._fused_loss_depth = 1
    try:
        yield on
    finally:
        trainer._fused_loss_depth = 0
        if patch is not None:
            patch.remove()


def with_fused_loss(method):
    """Decorator for a trainer method (`train`, `tune`): runs it inside `fused_loss_for(self)`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with fused_loss_for(self):
            return method(self, *args, **kwargs)

    return wrapper


__all__ = ["causal_lm_loss", "fused_lm_loss", "fused_loss_for", "installed_patch", "loss_path", "patch_model", "resolve_for_model",
           "resolve_fused_loss", "unsupported_reason", "with_fused_loss"]
