"""Save -> try -> restore: the probe and the checks leave no trace. `preserved` puts back weights, gradients, RNG
streams and training flags exactly, whatever happens inside (Lightning's batch-size scaler does the same in
`finally`); `modes_and_rng_preserved` keeps only modes and RNG (evaluation steps change no weights);
`fresh_optimizer_like` gives the probe its own optimizer, never touching the trainer's state.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..window.oom import free_memory


@dataclass
class _Saved:
    params: list[tuple[torch.Tensor, torch.Tensor]]
    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]]


def _save_rng() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


@contextlib.contextmanager
def modes_and_rng_preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run the block, then put every module's ``training`` flag and the torch, CUDA, numpy and ``random`` RNG
    states back, even on error (the engine probe restores the weights through DeepSpeed instead)."""
    modes, rng = [(m, m.training) for m in model.modules()], _save_rng()
    try:
        yield
    finally:
        for module, flag in modes:
            module.training = flag
        _restore_rng(rng)


@contextlib.contextmanager
def preserved(model: torch.nn.Module) -> Iterator[None]:
    """Run the block, then put the model and the RNG back exactly as they were, even on error.

    Saved: trainable parameters and all buffers (copies in CPU memory, so a GPU probe does not measure
    its own snapshot), gradients (the same tensor objects are reattached, their values copied back),
    every module's ``training`` flag, and the torch, CUDA, numpy and ``random`` RNG states.  Frozen
    parameters (a LoRA base, quantized weights) are not copied: no optimizer holds them, so a step
    cannot change them, and copying a frozen multi-GB base would cost more than the probe.
    """
    saved = _Saved(
        params=[(p, p.detach().to("cpu", copy=True)) for p in model.parameters() if p.requires_grad],
        buffers=[(b, b.detach().to("cpu", copy=True)) for b in model.buffers()],
        grads=[(p, None if p.grad is None else p.grad.detach().to("cpu", copy=True)) for p in model.parameters()],
    )
    grad_objects = {id(p): p.grad for p in model.parameters()}
    with modes_and_rng_preserved(model):
        try:
            yield
        finally:
            with torch.no_grad():
                for live, copy in saved.params + saved.buffers:
                    live.copy_(copy)
                for p, g in saved.grads:
                    if g is None:
                        p.grad = None
                    else:
                        original = grad_objects[id(p)]
                        original.copy_(g)
                        p.grad = original
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                # the probe's cached segments go back before training allocates; on CPU there is no cache to return
                # and a full collection of a process that imported transformers costs ~0.3 s for nothing
                free_memory()


def fresh_optimizer_like(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A new optimizer of the same class over the same parameter groups and hyperparameters, without
    state: the probe steps it and discards it, so the real one is never touched."""
    inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer wraps the real one
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])} for g in optimizer.param_groups
    ]
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # a class whose defaults hold keys its __init__ does not take; the groups carry them
        return type(optimizer)(groups)
