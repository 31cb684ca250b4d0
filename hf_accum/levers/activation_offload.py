"""Activation offload per decoder layer: what a chosen layer saves for the backward waits in host memory.

Around each chosen layer's forward, `torch.autograd.graph.save_on_cpu(pin_memory=True)` packs every tensor autograd
saves into (pinned) host memory and copies it back when the backward needs it. It trades device memory (the layer's
activations: about ``rows x seq x hidden x 16`` bytes per Llama layer in bf16) for two copies over the host link per
step, on the compute stream (torchtune and axolotl measured -5 to -7% peak for 0 to +4% step time). Tensors that share
a parameter's storage (a linear's weight, saved by its matmul) stay where they are: the weight lives on the device
anyway, and copying it would move gigabytes per step for nothing. The copies are bitwise, so the gradient is unchanged.

CUDA only: on CPU the activations already live in host memory (`why_unavailable` says so in one line, for the probe
log). transformers 5.24's ``activation_checkpointing_enable(offload=True)`` is not used: it moves only a *checkpointed*
layer's recompute inputs, for every layer at once, and 5.17 lacks it.

A layer that is checkpointed (fully or selectively) when it runs is not offloaded: the checkpoint keeps only its
inputs (or, selectively, the matmul outputs in its own cache, outside autograd's saved-tensor hooks), and saved-tensor
hooks pushed inside a non-reentrant checkpoint would change what the recompute sees. The test is made at each call
(`layer.gradient_checkpointing` and training and grad on), so the levels may change while layers stay offloaded.

Layers are laid out as the per-layer levers lay them out (`layout`): after the ``full`` fully and ``selective``
selectively checkpointed layers, the next ``offload`` layers are offloaded.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

from ..compat import gradient_checkpointing

_MARK = "_hf_accum_offload"


def why_unavailable(device) -> str | None:
    """None when activations on ``device`` can be offloaded to host memory; else the one line the probe log prints."""
    kind = torch.device(device).type
    if kind != "cuda":
        return (f"activation offload skipped: the model is on {kind}, where activations already live in host memory "
                "(the lever is CUDA only)")
    if not torch.cuda.is_available():
        return "activation offload skipped: CUDA is not available"
    return None


def available(device) -> bool:
    """Whether the offload lever exists on ``device`` (CUDA only)."""
    return why_unavailable(device) is None


def layout(num_layers: int, full: int, selective: int, offload: int) -> list[int]:
    """Indices of the offloaded layers: the ``offload`` layers after the ``full + selective`` checkpointed ones."""
    if min(full, selective, offload) < 0 or full + selective + offload > num_layers:
        raise ValueError(f"the model has {num_layers} decoder layers; cannot checkpoint {full} fully, {selective} "
                         f"selectively and offload {offload}")
    start = full + selective
    return list(range(start, start + offload))


def _storage(tensor) -> int | None:
    """The address of the storage behind ``tensor`` (None for a tensor subclass without one: it is offloaded)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class _KeepParameters(saved_tensors_hooks):
    """save_on_cpu's pack and unpack, except for tensors that share a parameter's storage (kept as they are)."""

    def __init__(self, layer, pin_memory: bool) -> None:
        inner = save_on_cpu(pin_memory=pin_memory)
        keep = {_storage(p) for p in layer.parameters()} - {None}

        def pack(tensor):
            if _storage(tensor) in keep:
                return False, tensor
            return True, inner.pack_hook(tensor)

        def unpack(packed):
            moved, value = packed
            return inner.unpack_hook(value) if moved else value

        super().__init__(pack, unpack)


def _checkpointed_now(layer) -> bool:
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training and torch.is_grad_enabled()


def _wrap(layer, pin_memory: bool) -> None:
    own = layer.__dict__.get("forward")  # an instance's own forward (another wrapper's), kept for unwrapping
    forward = layer.forward

    @functools.wraps(forward)
    def offloaded_forward(*args, **kwargs):
        if _checkpointed_now(layer) or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with _KeepParameters(layer, pin_memory):
            return forward(*args, **kwargs)

    setattr(offloaded_forward, _MARK, True)
    offloaded_forward._hf_accum_own = own
    layer.forward = offloaded_forward


def _unwrap(layer) -> None:
    wrapper = layer.__dict__.get("forward")
    if not getattr(wrapper, _MARK, False):
        return
    if wrapper._hf_accum_own is None:
        del layer.__dict__["forward"]
    else:
        layer.forward = wrapper._hf_accum_own


def _checked(model, indices) -> tuple[list, list[int]]:
    layers = gradient_checkpointing.checkpointable_layers(model)
    indices = list(indices)
    bad = [i for i in indices if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(layers)]
    if bad or len(set(indices)) != len(indices):
        raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layers (indices 0..{len(layers) - 1}); "
                         f"cannot offload layers {indices}")
    return layers, indices


def set_offloaded_layers(model, indices, pin_memory: bool = True) -> None:
    """Exactly the decoder layers at ``indices`` (0 = first) offloaded, every other layer not; [] removes every
    offload, leaving each layer's forward as it was. Idempotent (a plan applied twice wraps nothing twice)."""
    layers, indices = _checked(model, indices)  # refuses before the model is touched
    for layer in layers:
        _unwrap(layer)
    for i in indices:
        _wrap(layers[i], pin_memory)


@contextlib.contextmanager
def offloaded_layers(model, indices, pin_memory: bool = True):
    """`set_offloaded_layers` for the block (a probe trial); every layer exactly as it was after it, on error too."""
    layers, indices = _checked(model, indices)
    saved = [(layer, "forward" in layer.__dict__, layer.__dict__.get("forward")) for layer in layers]
    try:
        set_offloaded_layers(model, indices, pin_memory)
        yield
    finally:
        for layer, had, forward in saved:
            if had:
                layer.__dict__["forward"] = forward
            else:
                layer.__dict__.pop("forward", None)


def is_offloaded(layer) -> bool:
    return getattr(layer.__dict__.get("forward"), _MARK, False)


def offloaded_indices(model) -> list[int]:
    """Indices of the decoder layers offloaded now."""
    return [i for i, layer in enumerate(gradient_checkpointing.checkpointable_layers(model)) if is_offloaded(layer)]
