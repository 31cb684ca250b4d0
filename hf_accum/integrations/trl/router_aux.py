"""TRL's MoE router auxiliary (load-balancing) loss, given TRL's meaning inside hf_accum's window.

TRL >= 1.16 turns the router loss on for every MoE model (`trainer.aux_loss_enabled`, weight
`trainer.router_aux_loss_coef`). The router loss is a statistic of one forward's batch, so no cut of a window
reproduces it; TRL (and Megatron) define it per forward: SFTTrainer adds ``coef * aux / GA`` per micro-batch,
DPOTrainer ``coef * aux`` and `Trainer.training_step` divides by GA. Both sum to ``coef`` x the mean of ``aux`` over
the window's forwards. hf_accum multiplies each forward's loss by its token (or pair) share of the window, which
would scale that term by the share (1/GA on equal micro-batches) instead. So for the forward it wraps, hf_accum
takes the term out of TRL's loss (the weight is 0 during `compute_loss`), reads ``aux`` from the model's output
(a forward hook: asking `compute_loss` for its outputs costs TRL an extra forward), and adds
``coef * aux / forwards`` itself, ``forwards`` being the forwards this window runs (the same on every rank;
data-parallel averaging then makes it the mean over every rank's forwards, as in TRL). The token / pair loss stays
exact; the router term is the mean over the forwards that actually ran (TRL's when the window is not cut).

`tests/integrations/test_router_aux.py` pins the TRL attributes used here and that the result equals TRL's at GA 1, 2, 3.
"""

from __future__ import annotations

import contextlib

import torch


def enabled(trainer) -> bool:
    """Whether ``trainer`` (a TRL trainer) adds a router auxiliary loss to its training loss."""
    return bool(getattr(trainer, "aux_loss_enabled", False)) and bool(trainer.router_aux_loss_coef)


@contextlib.contextmanager
def taken_out(trainer, model):
    """During TRL's `compute_loss`: its router term weighs 0, and the training forward's ``aux_loss`` is captured
    (the forwards run with gradients: DPO's reference forward runs without). Nothing is changed for a trainer
    without a router loss."""
    captured: list[torch.Tensor] = []
    if not enabled(trainer):
        yield captured
        return
    coef = trainer.router_aux_loss_coef

    def hook(module, args, output):
        aux = getattr(output, "aux_loss", None)
        if aux is not None and torch.is_grad_enabled():
            captured.append(aux)

    handle = model.register_forward_hook(hook)
    trainer.router_aux_loss_coef = 0.0
    try:
        yield captured
    finally:
        trainer.router_aux_loss_coef = coef
        handle.remove()


def term(trainer, captured: list[torch.Tensor], forwards: int) -> torch.Tensor | None:
    """``coef * aux / forwards`` for the training forward captured (None when none was; the last one when a
    forward that ran out of memory was completed on a sliver, whose loss then counts 0)."""
    return captured[-1] * (trainer.router_aux_loss_coef / forwards) if captured else None


@contextlib.contextmanager
def off(trainer):
    """No router term at all (TRL's weight 0): the accumulation check compares one forward over a batch with the
    same batch cut into forwards, and the router term, a statistic of each forward's batch, differs by design."""
    if not enabled(trainer):
        yield
        return
    coef = trainer.router_aux_loss_coef
    trainer.router_aux_loss_coef = 0.0
    try:
        yield
    finally:
        trainer.router_aux_loss_coef = coef
