"""transformers' gradient checkpointing, per layer: which layers can recompute, how many do, and switching them
(used by the levers in `hf_accum/levers/`; what the user asked for is read there). Pinned by tests/levers/test_checkpoint_layers.py and tests/compat/test_compat.py.
"""

from __future__ import annotations

import contextlib

# peft's PeftModel.__init__ reads `model.is_gradient_checkpointing`, which transformers 5.23 renamed
# (`is_activation_checkpointing`; the old name warns). Our calls use the new names; this is peft's read, which no
# user can act on. Dropped by its exact text, around our own get_peft_model calls only (pinned in test_compat.py).
PEFT_READS_OLD_NAME = r"`is_gradient_checkpointing` is deprecated"


@contextlib.contextmanager
def peft_reads_quietly():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_READS_OLD_NAME, category=FutureWarning)
        yield


def enable_all(model, kwargs: dict | None) -> None:
    """transformers' own switch for every layer, as `Trainer.train()` turns it on (``kwargs`` for
    `torch.utils.checkpoint`); nothing on a model without the method. Idempotent."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


# transformers (5.17 and 5.24 alike) checkpoints a decoder layer when its class derives from
# `transformers.modeling_layers.GradientCheckpointingLayer` and the instance's `gradient_checkpointing` flag is True
# (in training, with grad enabled), through the `_gradient_checkpointing_func` that `*_checkpointing_enable` sets on
# every module carrying the flag. `every_n_layers` picks evenly spaced layers; hf_accum sets the flags itself to
# checkpoint exactly k layers, the first k: their recompute runs after the later layers' activations are freed in
# the backward, so it does not add to the peak (tests/compat/test_compat.py pins the flag and the enable path).
def checkpoint_owner(model):
    """The module whose `activation_checkpointing_enable` / `gradient_checkpointing_enable` applies (through peft's
    wrappers, which forward attribute access to the transformers model); None when there is none."""
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        method = getattr(model, name, None)
        if callable(method):
            return getattr(method, "__self__", model)
    return None


def checkpointable_layers(model) -> list:
    """The decoder layers transformers checkpoints one by one (`GradientCheckpointingLayer` instances, in forward
    order), through peft wrappers; [] when the model has none (then checkpointing is on or off only)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - both supported versions have it
        return []
    if checkpoint_owner(model) is None:
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def can_checkpoint(model) -> bool:
    """Whether checkpointing can be switched on for ``model`` at all."""
    owner = checkpoint_owner(model)
    return owner is not None and getattr(owner, "supports_gradient_checkpointing", True) is not False


def checkpoint_levels(model) -> int:
    """How many levels of checkpointing exist: L for L checkpointable layers, 1 for on/off only, 0 for none."""
    if not can_checkpoint(model):
        return 0
    return len(checkpointable_layers(model)) or 1


def _enable_all(model, kwargs: dict | None) -> None:
    owner = checkpoint_owner(model)
    if owner is None or not can_checkpoint(model):
        raise ValueError(f"{type(model).__name__} cannot checkpoint activations (it has no "
                         "activation_checkpointing_enable / gradient_checkpointing_enable).")
    if hasattr(owner, "activation_checkpointing_enable"):
        owner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    else:
        owner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def _disable_all(model) -> None:
    owner = checkpoint_owner(model)
    if owner is None:
        return
    if hasattr(owner, "activation_checkpointing_disable"):
        owner.activation_checkpointing_disable()
    elif hasattr(owner, "gradient_checkpointing_disable"):
        owner.gradient_checkpointing_disable()


def checkpointed_count(model) -> int:
    """How many levels recompute now: checkpointed layers, or 1/0 for an on/off model."""
    layers = checkpointable_layers(model)
    if layers:
        return sum(bool(getattr(m, "gradient_checkpointing", False)) for m in layers)
    return int(any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()))


def set_checkpointed_layers(model, k: int, kwargs: dict | None = None) -> None:
    """Exactly ``k`` of the model's L levels recompute in the backward (`checkpoint_levels`): k=0 switches
    checkpointing off, k=L on for every layer, 0<k<L the first k decoder layers. For k>0 transformers' own enable runs
    first (it sets the checkpoint function, ``kwargs`` for `torch.utils.checkpoint`, and the input-embedding hook that
    makes frozen embeddings' output require grad, which LoRA needs with reentrant checkpointing)."""
    levels = checkpoint_levels(model)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= levels:
        raise ValueError(f"{type(model).__name__} has {levels} checkpointable layers; cannot checkpoint {k!r}")
    if k == 0:
        if checkpointed_count(model):
            _disable_all(model)
        return
    _enable_all(model, kwargs)
    for index, layer in enumerate(checkpointable_layers(model)):
        layer.gradient_checkpointing = index < k


_CHECKPOINT_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


@contextlib.contextmanager
def checkpointed_layers(model, k: int, kwargs: dict | None = None):
    """`set_checkpointed_layers(model, k, kwargs)` for the block (a probe trial), then every module's checkpointing
    flag and function and the input-embedding hooks exactly as they were, even on error."""
    saved = [(m, {a: m.__dict__[a] for a in _CHECKPOINT_ATTRS if a in m.__dict__}) for m in model.modules()]
    hooks = {id(m): list(getattr(m, "_require_grads_hooks", None) or []) for m in model.modules()}
    try:
        set_checkpointed_layers(model, k, kwargs)
        yield
    finally:
        for module, attrs in saved:
            for name in _CHECKPOINT_ATTRS:
                if name in attrs:
                    module.__dict__[name] = attrs[name]
                else:
                    module.__dict__.pop(name, None)
        for module in model.modules():
            before = hooks.get(id(module), [])
            now = getattr(module, "_require_grads_hooks", None)
            if now is None or now == before:
                continue
            for hook in now:
                if all(hook is not b for b in before):
                    hook.remove()
            module._require_grads_hooks = before
            if before:
                module._require_grads_hook = before[0]
            else:
                module.__dict__.pop("_require_grads_hook", None)
