"""Exact accumulation for your own PyTorch / accelerate loop: the window engine without the Trainer.

    from hf_accum.loop import Accumulator, windows

    acc = Accumulator(model)                      # model as trained: plain, DDP- or FSDP2-wrapped
    for window in windows(loader, 4):             # 4 micro-batches per optimizer step (the last may be shorter)
        loss = acc.backward(window, lambda m, batch: m(**batch).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

``loss_fn(model, batch)`` returns the *mean* loss of its batch over the batch's own count (what a transformers
model returns with ``labels``; for "samples", the mean over its samples). ``backward`` accumulates, in ``.grad``,
exactly the gradient of one pass over the whole window on every rank: the sum of token (or sample) losses over
the window divided by their number. Only the window's last forward/backward synchronizes gradients (DDP's
``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``). On an out-of-memory error the window is re-run from
its start in chunks of half as many units (rows, padding-free sequences or pairs), gradients of the window
cleared first -- so zero the gradients after every optimizer step, as above. With several ranks the rules of
`protocol.py` apply: DDP re-runs together; FSDP2 (collectives in every forward) stops every rank with a clear
error instead of hanging.

Checkpoints: ``acc.state_dict()`` / ``acc.load_state_dict()`` carry the cut in force after an OOM, so a resumed run
keeps it. Save them with the model and optimizer; under FSDP2, with torch.distributed.checkpoint (each rank writes
its own shards), e.g. ``dcp.save({"model": model_sd, "optim": optim_sd, "accumulator": acc.state_dict()}, ...)``
with ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` (docs/scaling.md, "Scaling out").

The probe and plan are available too (`hf_accum.probing.probe.probe_model`), to choose the micro-batch before the loop.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from .compat import parallel, process_group
from .window.engine import WindowEngine
from .window.loss import IGNORE_INDEX, NORMALIZATIONS, LabelSpec, loss_shifts_labels
from .window.protocol import Local, Policy, StopTraining, TorchDistributed, WindowProtocol
from .window.units import detect_unit, make_cutter


def windows(batches: Iterable, accumulation_steps: int) -> Iterator[list]:
    """Group consecutive micro-batches into windows of ``accumulation_steps`` (the last one may be shorter)."""
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps!r} must be a positive integer.")
    it = iter(batches)
    while window := list(itertools.islice(it, accumulation_steps)):
        yield window


class Accumulator:
    """Runs one accumulation window exactly (see the module docstring)."""

    def __init__(self, model: nn.Module, *, normalization: str = "tokens", label_key: str = "labels",
                 ignore_index: int = IGNORE_INDEX, shift_labels: bool | None = None, unit: str | None = None):
        if normalization not in NORMALIZATIONS[:2]:
            raise ValueError(f"normalization={normalization!r} must be 'tokens' or 'samples'.")
        self.model = model
        inner = parallel.unwrap_parallel(model)
        shift = loss_shifts_labels(inner) if shift_labels is None else shift_labels
        self.labels = LabelSpec(label_key, ignore_index, shift)
        self.normalization = normalization
        self.unit = unit
        self.world = process_group.world_size()
        self.policy = Policy.STOP if parallel.is_fsdp2(model) else Policy.RERUN
        self._engine: WindowEngine | None = None
        self._cut_units: int | None = None  # from `load_state_dict`, until the engine exists

    def backward(self, batches: list[Mapping], loss_fn: Callable[[nn.Module, Mapping], torch.Tensor]) -> torch.Tensor:
        """Forward and backward over every micro-batch of the window; returns this rank's share of the window loss
        (the window loss itself on one process; averaged over ranks it is the window loss)."""
        engine = self._engine_for(batches[0])
        engine.begin(batches)
        total = None
        try:
            for b in batches:
                part = engine.step(b, lambda chunk, final: self._chunk(engine, chunk, final, loss_fn))
                total = part if total is None else total + part
        except StopTraining as exc:
            units = engine.cut_units or engine.largest_loaded_units()
            raise StopTraining(
                f"hf_accum: {exc}; a rank cannot skip or re-run a forward alone without hanging the others, so every "
                f"rank stops. Restart from your last checkpoint with micro-batches of at most {max(1, units // 2)} "
                "(and as many more per window, to keep the effective batch)."
            ) from None
        finally:
            engine.end()
        return total

    def _chunk(self, engine: WindowEngine, chunk, final: bool, loss_fn) -> torch.Tensor:
        share = engine.share(engine.cutter.count(chunk, self.normalization))
        with contextlib.nullcontext() if final else parallel.no_gradient_sync(self.model):
            if final:
                loss, keep = engine.final_forward(lambda b: loss_fn(self.model, b), chunk)
            else:
                loss, keep = loss_fn(self.model, chunk), 1.0
            scaled = loss * share.to(loss.device, loss.dtype) * keep
            scaled.backward()
        return scaled.detach()

    def _engine_for(self, batch) -> WindowEngine:
        if self._engine is None:
            cutter = make_cutter(self.unit or detect_unit(batch), self.labels)
            device = next(self.model.parameters()).device
            collective = TorchDistributed(self.world, device) if self.world > 1 else Local()
            self._engine = WindowEngine(cutter, self.normalization, WindowProtocol(collective, self.policy),
                                        shrink=self._halve, reset=self._zero_grad, device=device)
            self._engine.cut_units = self._cut_units
        return self._engine

    def _halve(self, units: int | None) -> int:
        current = units or self._engine.largest_loaded_units()
        if current <= 1:
            raise RuntimeError("hf_accum: out of memory with one unit per forward; nothing smaller to try. "
                               "Shorten sequences, enable gradient checkpointing or train LoRA adapters.")
        return current // 2

    def _zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    @property
    def cut_units(self) -> int | None:
        """Units per forward in force after an out-of-memory error (None: batches as loaded)."""
        return self._engine.cut_units if self._engine is not None else self._cut_units

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint must carry to resume with the same cut (0: batches as loaded)."""
        return {"cut_units": self.cut_units or 0}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._cut_units = int(state["cut_units"]) or None
        if self._engine is not None:
            self._engine.cut_units = self._cut_units


__all__ = ["Accumulator", "windows"]
