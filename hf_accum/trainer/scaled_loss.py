"""The one place a trainer's `compute_loss` (a user's override included) is wrapped: for one forward its loss is
multiplied by the chunk's exact share of the window (`loss_scaled`), and what transformers' `training_step` then
backpropagated is checked once against that share (`check_post_processing`)."""

from __future__ import annotations

import contextlib
import math

import torch

from ..integrations.trl import dpo_sft, router_aux


@contextlib.contextmanager
def loss_scaled(trainer, engine, scale, final: bool, undo=1):
    """The one place the class's `compute_loss` (a user's override included) is wrapped, for one step: its
    loss is multiplied by ``scale``; the window's final forward runs through the engine so that every rank
    agrees before the gradient-synchronizing backward. A TRL MoE router loss is taken out and added back as
    its mean over the window's forwards (router_aux.py; ``undo`` pre-compensates training_step's division)."""
    original = trainer.compute_loss
    raw: list[torch.Tensor] = []

    def compute_loss(model, inputs, *args, **kwargs):
        with router_aux.taken_out(trainer, model) as captured, dpo_sft.reweighted(trainer, inputs, scale / undo):
            if final:
                out, keep = engine.final_forward(lambda b, *a, **k: original(model, b, *a, **k), inputs,
                                                 *args, **kwargs)
            else:
                out, keep = original(model, inputs, *args, **kwargs), 1.0
        loss, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
        raw.append(loss.detach())
        loss = loss * scale.to(loss.device, loss.dtype)
        term = router_aux.term(trainer, captured, engine.forwards())
        if term is not None:
            raw.append(term.detach())  # the expected returned value gains it (check_post_processing)
            loss = loss + term.to(loss.dtype) * undo
        loss = loss * keep
        return (loss, *rest) if rest is not None else loss

    trainer.compute_loss = compute_loss
    try:
        yield raw
    finally:
        del trainer.compute_loss


def check_post_processing(returned, raw, share) -> None:
    # What training_step backpropagated must be the chunk's exact share of the window loss; otherwise
    # transformers changed its rule and `compat.trainer_internals` needs updating. Checked once (by the caller):
    # it costs a device sync.
    if not raw:
        return
    expected = float(raw[0] * share.to(raw[0].device, raw[0].dtype) + sum(raw[1:]))
    got = float(returned)
    if not math.isclose(got, expected, rel_tol=1e-5, abs_tol=1e-12) and math.isfinite(expected):
        raise RuntimeError(
            f"hf_accum: transformers' training_step rescaled the loss ({got} != {expected}); this transformers "
            "version post-processes the loss differently from what hf_accum.compat.trainer_internals expects. Please "
            "report it; set loss_normalization='model' meanwhile."
        )
