"""TRL internals hf_accum touches: the metrics TRL gathers inside compute_loss (kept out of the probe's steps)
and whether TRL fuses the LM head. Pinned by tests/test_trl.py and tests/test_compat.py.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def trl_metrics_untouched(trainer):
    """TRL trainers append to `_metrics` and count `_total_train_tokens` in `compute_loss`; the probe's and the
    accumulation check's steps are not training, so both are restored after them."""
    import copy

    metrics = copy.deepcopy(trainer.__dict__.get("_metrics"))
    tokens = trainer.__dict__.get("_total_train_tokens")
    try:
        yield
    finally:
        if metrics is not None:
            trainer._metrics = metrics
        if tokens is not None:
            trainer._total_train_tokens = tokens


def trl_metrics_kept(method):
    """``method`` of a trainer run under `trl_metrics_untouched` (a no-op for trainers that keep no TRL metrics)."""
    import functools

    @functools.wraps(method)
    def wrapped(trainer, *args, **kwargs):
        with trl_metrics_untouched(trainer):
            return method(trainer, *args, **kwargs)

    return wrapped


def trl_counts_tokens(trainer) -> bool:
    """Whether ``trainer`` keeps TRL's `num_tokens` metric (`_total_train_tokens`, counted in `compute_loss`). TRL logs
    it at evaluation too, as ``eval_num_tokens``: the training tokens seen so far, not the evaluation's."""
    return "_total_train_tokens" in vars(trainer)


def trl_fuses_lm_head() -> bool:
    """Whether TRL's SFTTrainer computes its loss through `add_fused_lm_head` (a patched `model.forward` called with
    `fused_lm_head=True`, TRL >= 1.x) rather than from the model's logits."""
    try:
        from trl.trainer import utils
    except ImportError:
        return False
    return hasattr(utils, "add_fused_lm_head")
