"""The window engine: runs one accumulation window (the per-rank batches of one optimizer step) as forwards of
whatever size memory allows, each scaled to its exact share of the window loss. It knows no `Trainer`.

    engine.begin(batches)                    # count the window on every rank (see protocol.py)
    for batch in batches:
        engine.step(batch, run_chunk)        # cut by the batch's unit, forward/backward each chunk, OOM-safe

``run_chunk(chunk, final)`` is the caller's forward+backward of one chunk; it multiplies its mean loss by
``engine.share(count)`` and, for the final chunk, runs its forward through ``engine.final_forward`` so ranks
agree before the gradient-synchronizing backward. On an out-of-memory error the engine asks ``shrink()`` for a
smaller cut (units per forward; it is given the cut in force, None for "as loaded", and raises when
there is none) and re-runs the whole window from its start with gradients cleared (``reset``);
what it returns for the re-run window makes the caller's running loss equal that window's loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .cuts import forwards_for
from .loss import Window
from .oom import free_memory, guarded
from .protocol import Local, Phase, Policy, Restart, StopTraining, WindowProtocol
from .token_budget import TokenBudget
from .units import Cutter, sliver


class WindowEngine:
    def __init__(self, cutter: Cutter, mode: str, protocol: WindowProtocol | None = None, *,
                 shrink: Callable[[int | None], int] | None = None, reset: Callable[[], None] | None = None,
                 shrink_tokens: Callable[[TokenBudget], TokenBudget] | None = None, device=None):
        self.cutter = cutter
        self.mode = mode
        self.protocol = protocol or WindowProtocol(Local(), Policy.RERUN)
        self.shrink = shrink or _cannot_shrink
        self.shrink_tokens = shrink_tokens or _cannot_shrink
        self.reset = reset or (lambda: None)
        self.device = device
        self.cut_units: int | None = None  # most units per forward (the plan's, or after an OOM); None: as loaded
        self.token_budget: TokenBudget | None = None  # micro_batching="tokens": what one forward may hold
        self._forwards: tuple[int, ...] = ()  # per loaded batch, agreed over ranks
        self.window: Window | None = None
        self._batches: Sequence = ()
        self._index = 0
        self._returned: list[torch.Tensor] = []
        self.stop_requested: Callable[[], bool] = lambda: False  # e.g. a signal arrived (preemption.py)
        self.gradients_finite: Callable[[], torch.Tensor | None] = lambda: None  # checked with the loss when done
        self.outcome = WindowOutcome()
        self._reran = False  # this window was re-run after an OOM (on every rank: they re-run together)

    @property
    def active(self) -> bool:
        return self.window is not None and self._index < len(self._batches)

    @property
    def world(self) -> int:
        return self.protocol.world

    # --- the window -----------------------------------------------------------------------------------------
    def begin(self, batches: Sequence) -> Window:
        local = sum(self.cutter.count(b, self.mode).to(self.device or "cpu") for b in batches)
        total = self.protocol.begin(torch.as_tensor(local))
        if int(total) == 0:
            raise ValueError(
                "An accumulation window has no counted labels (every label is ignored, after the causal shift), so "
                f"loss_normalization={self.mode!r} cannot normalize it. Check that the collator masks only "
                "prompt/padding tokens, drop examples without targets, or set loss_normalization='model'."
            )
        self.window = Window(items=total, world=self.world)
        self._batches, self._index, self._returned = list(batches), 0, []
        self._reran = False
        self._agree_forwards()
        return self.window

    def _agree_forwards(self) -> None:
        if self.token_budget is not None:
            own = tuple(self.cutter.forwards_under(b, self.token_budget) for b in self._batches)
        elif self.cut_units:
            own = tuple(forwards_for(self.cutter.units(b), self.cut_units) for b in self._batches)
        else:
            self._forwards = ()
            return
        self._forwards = self.protocol.agree_forwards(own)

    def largest_loaded_units(self) -> int:
        """Units of the largest batch of the current window, as loaded."""
        return max(self.cutter.units(b) for b in self._batches)

    def longest_loaded_unit(self) -> int:
        """Tokens of the longest unit of the current window (what a token budget must at least hold)."""
        return max(max(self.cutter.lengths(b)) for b in self._batches)

    def share(self, local_count: torch.Tensor) -> torch.Tensor:
        return self.window.scale(local_count)

    def forwards(self) -> int:
        """Forwards this window runs, agreed over ranks (a per-forward term such as the MoE router loss is
        averaged over them: router_aux.py)."""
        return sum(self._forwards) if self._forwards else len(self._batches)

    def step(self, batch, run_chunk) -> torch.Tensor:
        """One loaded batch of the window (the next one): its chunks' summed returned losses."""
        index = self._index
        last = index == len(self._batches) - 1
        self._index += 1
        try:
            returned = self._run_loaded(batch, index, run_chunk)
        except Restart:
            returned = self._rerun_window(run_chunk)
        except StopTraining:
            raise
        except Exception as exc:
            reason = self.protocol.peer_stopped()
            if reason is None:
                raise
            raise StopTraining(f"{reason} on another rank (this rank's pending collective failed as that rank "
                               "left)") from exc
        self._returned.append(returned)
        if last:
            self._done()
        return returned

    def _done(self) -> None:
        loss = sum(self._returned[1:], self._returned[0])
        finite = torch.isfinite(loss).all()
        grads = self.gradients_finite()  # on the device: still one host sync (finite_grads.py)
        if grads is not None:
            finite = finite & grads.to(finite.device)
        nonfinite = not bool(finite)  # one host sync per optimizer step, none per micro-step
        skip, stop = self.protocol.done(nonfinite, self.stop_requested())
        self.outcome = WindowOutcome(skip=skip, stop=stop, loss=loss.detach(), reran=self._reran)

    def end(self) -> None:
        self.window, self._batches, self._index, self._returned = None, (), 0, []
        self.protocol.finish()

    # --- chunks ----------------------------------------------------------------------------------------------
    def _chunks(self, batch, index: int) -> list:
        groups = self._forwards[index] if index < len(self._forwards) else None
        if self.token_budget is not None:
            return self.cutter.cut_by_tokens(batch, self.token_budget, groups, self.mode)
        return self.cutter.cut_near_equal(batch, self.cut_units, groups, self.mode) if self.cut_units else [batch]

    def _run_loaded(self, batch, index: int, run_chunk) -> torch.Tensor:
        last = index == len(self._batches) - 1
        chunks = self._chunks(batch, index)
        total = None
        for j, chunk in enumerate(chunks):
            part = self._run_chunk(chunk, last and j == len(chunks) - 1, run_chunk)
            total = part if total is None else total + part
        return total

    def _run_chunk(self, chunk, final: bool, run_chunk) -> torch.Tensor:
        if final:
            self.protocol.before_final()  # raises Restart on every rank together
        elif self.protocol.skipping:  # this window is re-run anyway
            return self._zero()
        returned, oom = guarded(lambda: run_chunk(chunk, final), never=(Restart,))
        if oom:
            if not final:
                self.protocol.micro_oom()
                return self._zero()
            self.protocol.final_backward_oom()  # Restart (one process) or StopTraining
        if self.protocol.phase is Phase.DRAINING:
            self.protocol.drained()  # the aborted synchronized iteration is complete: Restart
        return returned

    def final_forward(self, forward: Callable, inputs, *args, **kwargs):
        """Runs the window's final forward (``forward(inputs, ...)``, e.g. `compute_loss`) and agrees with the
        other ranks before its backward. Returns ``(output, keep)``: ``keep`` is 0.0 when this iteration only
        completes DDP's synchronized step before every rank re-runs the window (multiply the loss by it)."""
        spare = sliver(inputs, self.cutter.unit) if self.world > 1 else None  # compute_loss may pop labels
        out, oom = guarded(lambda: forward(inputs, *args, **kwargs))
        if not self.protocol.after_final_forward(oom):
            return out, 1.0
        if oom:  # the other ranks ran a synchronizing forward: complete that iteration on a sliver
            out = forward(spare, *args, **kwargs)
        return out, 0.0

    def _rerun_window(self, run_chunk) -> torch.Tensor:
        self._reran = True
        while True:
            if self.token_budget is not None:
                self.token_budget = self.shrink_tokens(self.token_budget)
            else:
                self.cut_units = self.shrink(self.cut_units)  # raises when nothing smaller keeps the effective batch
            self.protocol.rerun()
            self._agree_forwards()
            self.reset()
            free_memory()
            try:
                parts = [self._run_loaded(b, i, run_chunk) for i, b in enumerate(self._batches)]
            except Restart:
                continue
            total = sum(parts[1:], parts[0])
            return total - sum(self._returned, torch.zeros_like(total))

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), device=self.device)


@dataclass(frozen=True)
class WindowOutcome:
    """What the ranks agreed when the window's gradients were complete."""

    skip: bool = False  # some rank's window loss or gradients were not finite: no optimizer step on this window
    stop: bool = False  # some rank was asked to stop: every rank stops after this step
    loss: torch.Tensor | None = None  # this rank's share of the window loss
    reran: bool = False  # an OOM lowered the cut and the window was re-run (the planner's growing back counts it)


def _cannot_shrink(units):
    raise RuntimeError("out of memory, and no smaller cut was configured")


@contextlib.contextmanager
def using(owner, engine: WindowEngine):
    """Temporarily swap ``owner._engine`` (the accumulation check runs its own, local engine)."""
    saved = owner._engine
    owner._engine = engine
    try:
        yield engine
    finally:
        owner._engine = saved
