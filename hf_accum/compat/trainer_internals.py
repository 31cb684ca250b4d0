"""The one place that knows how transformers' `Trainer.training_step` post-processes the loss.

`training_step` divides the value returned by `compute_loss` by the number of micro-batches in the window
unless it believes the loss is already normalized for accumulation. The rule changed between versions:
- transformers 5.17: divides iff `(not model_accepts_loss_kwargs or num_items_in_batch is None)
  and compute_loss_func is None`;
- transformers >= 5.2x: a class attribute `loss_is_scaled_for_ga` overrides that rule when not None.
`tests/compat/test_compat.py` fails when a new version changes this, and `AccumTrainer` checks the returned value
of its first training step against this prediction at run time.

Also the private Trainer fields the window engine, the evaluation and the check read or set (each with the test
that pins it in tests/compat/test_compat.py), and the two private Trainer methods `AccumulationMixin` overrides instead of
adding callbacks to the user's list: `_maybe_log_save_evaluate` (the loop calls it right after the callbacks'
`on_step_end`, before it logs and saves) and `_save_checkpoint` (where `on_save` would come right after).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import Trainer

# Older versions ignore the attribute even when a subclass sets it.
HAS_LOSS_IS_SCALED_FOR_GA = hasattr(Trainer, "loss_is_scaled_for_ga")


def computes_own_loss(trainer) -> bool:
    """The trainer's loss is not the model's own: a ``compute_loss_func`` or a ``compute_loss`` override."""
    return trainer.compute_loss_func is not None or type(trainer).compute_loss is not Trainer.compute_loss


def trainer_divides_by_accumulation(trainer, num_items_in_batch) -> bool:
    declared = getattr(trainer, "loss_is_scaled_for_ga", None) if HAS_LOSS_IS_SCALED_FOR_GA else None
    if declared is not None:
        return not declared
    scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
        trainer.compute_loss_func is not None
    )
    return not scaled


@contextlib.contextmanager
def printers_without(trainer, keys):
    """transformers' console callbacks (`ProgressCallback`, `PrinterCallback`) print every dict `Trainer.log` sends.
    The plan's figures ride on the run's first log entry for `log_history` and the `report_to` integrations (the one
    plan line already said them), so for that one call the console callbacks in the handler's `callbacks` list see
    the entry without ``keys``; whatever a printer takes out of what it sees (`total_flos`) leaves the entry too,
    as it would have."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    handler = trainer.callback_handler
    kept = handler.callbacks
    handler.callbacks = [_Without(c, frozenset(keys)) if isinstance(c, PrinterCallback | ProgressCallback) else c
                         for c in kept]
    try:
        yield
    finally:
        handler.callbacks = kept


class _Without:
    """A console callback that is handed each log entry without some keys (`printers_without`)."""

    def __init__(self, callback, keys: frozenset):
        self._callback, self._keys = callback, keys

    def __getattr__(self, name):
        return getattr(self._callback, name)

    def on_log(self, args, state, control, logs=None, **kwargs):
        shown = {k: v for k, v in (logs or {}).items() if k not in self._keys}
        result = self._callback.on_log(args, state, control, logs=shown, **kwargs)
        for key in [k for k in (logs or {}) if k not in self._keys and k not in shown]:
            del logs[key]
        return result


def main_input_tokens(trainer, inputs) -> int:
    """Token positions of the main input, as the Trainer counts them (`Trainer._track_num_input_tokens`, the
    model's `floating_point_ops`); 0 when the batch has none."""
    main = getattr(trainer.model, "main_input_name", "input_ids")
    value = inputs.get(main) if isinstance(inputs, dict) else None
    return int(value.numel()) if torch.is_tensor(value) else 0


def add_input_tokens_seen(trainer, local_tokens: int) -> None:
    """What `Trainer._track_num_input_tokens` does with its count (summed over ranks into the state); the
    Trainer's loop calls that method with each loaded batch, which `AccumulationMixin` overrides."""
    tokens = torch.as_tensor(local_tokens, device=trainer.args.device, dtype=torch.int64)
    trainer.state.num_input_tokens_seen += trainer.accelerator.gather(tokens).sum().item()


def window_length(trainer) -> int:
    """Micro-batches in the current window: `Trainer.training_step` divides the loss by this private attribute
    (set by `_inner_training_loop` per window); `tests/compat/test_compat.py` pins that it is the divisor."""
    return trainer.current_gradient_accumulation_steps


@contextlib.contextmanager
def window_length_set(trainer, length: int):
    """Set it for steps run outside the Trainer's loop (the accumulation check), restored after."""
    saved = trainer.__dict__.get("current_gradient_accumulation_steps", _MISSING)
    trainer.current_gradient_accumulation_steps = length
    try:
        yield
    finally:
        if saved is _MISSING:
            del trainer.current_gradient_accumulation_steps
        else:
            trainer.current_gradient_accumulation_steps = saved


_MISSING = object()


def one_forward_window(trainer):
    """A forward that is a window of its own (a probe step, an evaluation forward): `window_length` 1 while it runs.
    TRL's SFT `compute_loss` reads the attribute for its MoE router term whenever it gets `num_items_in_batch`,
    and only the Trainer's loop sets it."""
    return window_length_set(trainer, 1)


def prepare_inputs(trainer, batch):
    """Move a collated batch to the device as the training loop does (`Trainer._prepare_inputs`)."""
    return trainer._prepare_inputs(batch)


@contextlib.contextmanager
def prediction_loss_counted(trainer, num_items):
    """Inside, the `compute_loss` calls of a `prediction_step` get ``num_items`` as `num_items_in_batch`:
    transformers' (5.17 to 5.24) passes its own count there (`_get_num_items_in_batch`, gathered over ranks when
    `average_tokens_across_devices` is on); TRL's passes none, and `Trainer.training_step` always passes it, so
    every `compute_loss` accepts it. Yields what each call returned as its loss; None is appended for a call that
    gave the count positionally, whose loss hf_accum then cannot drive. ``num_items`` None: only records."""
    original = trainer.compute_loss
    seen: list = []

    def compute_loss(model, inputs, *args, **kwargs):
        driven = len(args) < 2  # (return_outputs, num_items_in_batch) positionally: not ours to replace
        if driven and num_items is not None:
            kwargs["num_items_in_batch"] = num_items
        # TRL's SFT loss divides its MoE router term by the window's length when given a count; its own
        # prediction_step gives none (one forward, weight 1), and outside training the length is not even set
        with one_forward_window(trainer):
            out = original(model, inputs, *args, **kwargs)
        seen.append((out[0] if isinstance(out, tuple) else out) if driven else None)
        return out

    trainer.compute_loss = compute_loss
    try:
        yield seen
    finally:
        del trainer.compute_loss


def eval_rows_kept(trainer, rows: int) -> tuple[int, int | None]:
    """(how many of this rank's ``rows``, the eval batch being run, `Accelerator.gather_for_metrics` keeps; the row
    at which every rank cuts its last batch when some rank keeps only part of its own, else None).

    With several ranks and `even_batches`, accelerate completes the ranks' last batches with samples from the start
    of the data set, all of one size, and at the end of the dataloader keeps the first `gradient_state.remainder`
    gathered rows (rank 0's batch, then rank 1's, ...); transformers' eval_loss and predictions drop the rest. The
    cut is the same on every rank (the remainder modulo the batch), so every rank runs as many forwards."""
    accelerator = trainer.accelerator
    state = accelerator.gradient_state
    if accelerator.num_processes == 1 or not getattr(accelerator, "even_batches", True):
        return rows, None
    if not state.end_of_dataloader or state.remainder is None or state.remainder <= 0 or rows == 0:
        return rows, None
    kept = max(0, min(rows, state.remainder - accelerator.process_index * rows))
    return kept, (state.remainder % rows or None)
