"""DPO's ``loss_type="sft"`` term, exact over the window: it is a token mean (the negative log-likelihood of the
chosen completions' tokens), not a mean over pairs, so it gets its own count, as hf_accum's token loss does.

Each forward's loss is multiplied by its pair share of the window (``pair_share = p * W / P``). For the forward it
wraps, hf_accum sets the sft term's weight in `DPOTrainer.loss_weights` to ``weight * token_share / pair_share``,
``token_share = n * W / N``: ``n`` the chosen completion tokens of the forward (after the causal shift, as TRL counts
them), ``N`` those of the whole window on every rank (one collective per window). So the term contributes
``weight * (sum of the chosen tokens' NLL) / N`` per forward, and the window's loss holds ``weight x`` the token mean
over the window, whatever the cut. `tests/integrations/test_dpo.py` checks it against a float64 reference written by hand.
"""

from __future__ import annotations

import contextlib

import torch

SFT = "sft"


def enabled(trainer) -> bool:
    """Whether ``trainer`` is a DPO trainer with an sft term (`DPOTrainer.loss_types` / `loss_weights`)."""
    return SFT in (getattr(trainer, "loss_types", None) or ())


def chosen_tokens(batch) -> torch.Tensor:
    """Chosen completion tokens of a [chosen; rejected] batch, after the causal shift (TRL's
    ``shift_completion_mask.chunk(2)[0]``)."""
    mask = batch["completion_mask"]
    return mask[: mask.shape[0] // 2, 1:].sum()


def _window_tokens(trainer, engine) -> torch.Tensor:
    cached = getattr(trainer, "_dpo_sft_window", None)
    if cached is not None and cached[0] is engine.window:
        return cached[1]
    local = sum(chosen_tokens(b).to(engine.device or "cpu") for b in engine._batches)
    total = engine.protocol.collective.sum(local) if engine.world > 1 else local
    if int(total) == 0:
        raise ValueError("An accumulation window has no chosen completion tokens, so DPO's loss_type='sft' term (a "
                         "token mean) is undefined. Drop pairs with empty chosen completions.")
    trainer._dpo_sft_window = (engine.window, total)
    return total


@contextlib.contextmanager
def reweighted(trainer, inputs, pair_share: torch.Tensor):
    """During one forward's `compute_loss`: the sft term weighted to its exact share of the window's token mean."""
    if not enabled(trainer):
        yield
        return
    engine = trainer._engine
    weights = list(trainer.loss_weights)
    index = trainer.loss_types.index(SFT)
    total = _window_tokens(trainer, engine).to(torch.float64)
    token_share = chosen_tokens(inputs).to(total.device, torch.float64) * engine.world / total
    trainer.loss_weights = [*weights[:index], weights[index] * token_share / pair_share.to(total.device, torch.float64),
                            *weights[index + 1:]]
    try:
        yield
    finally:
        trainer.loss_weights = weights
